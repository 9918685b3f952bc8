"""Transformer.set_pdl: the programmatic dependent launch switch (docs/pdl.md) reaches every module and every
kernel call that takes it (FP8 linears through `Linear` and `linear_pair`, the RMSNorms, the rope kernels, the
CSA2 norms), and turning it on changes no logit. On the CPU the kernels never use PDL (`use_pdl`), so this checks
the plumbing; tests/worker/test_cuda_graph_pdl_cuda.py checks the numbers on the GPU inside CUDA graphs."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from deepinfer_engine.model import attention, csa2, linear, linear_pair
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.model.loader import load_model

# (engine module, kernel entry point it calls): every call site that takes `pdl`
SITES = [
    (linear, "fp8_linear"),
    (linear, "fp8_linear_grouped"),
    (linear_pair, "fp8_linear"),
    (attention, "rms_norm"),
    (attention, "apply_rope"),
    (attention, "apply_rope_at"),
    (csa2, "rms_norm"),
]


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    m = load_model(tiny_ckpt("v41"), dtype=torch.float32)  # FP8 linears (checkpoint format), fused pairs, CSA2
    m.set_kernel_backend("torch")  # the references: the call sites are the same, the CPU time is not
    return m


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """(module, entry point, pdl keyword) -> number of calls, recorded while the real kernel runs."""
    seen: Counter = Counter()

    def recorder(site: tuple[str, str], real):
        def record(*a, **kw):
            seen[(*site, kw.get("pdl"))] += 1
            return real(*a, **kw)

        return record

    for mod, name in SITES:
        monkeypatch.setattr(mod, name, recorder((_short(mod), name), getattr(mod, name)))
    return seen


def _short(mod) -> str:
    return mod.__name__.rsplit(".", 1)[-1]


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    cache, bt = ModelCache.allocate_dense(model.args, [len(ids) + 1], dtype=torch.float32)
    with torch.inference_mode():
        prefill = model(ForwardBatch.single(ids, block_table=bt[0]), cache)
        step = model(ForwardBatch.single(ids[-1:], start_pos=len(ids), block_table=bt[0]), cache)  # a decode step
    return torch.cat([prefill, step])


def test_set_pdl_reaches_every_module(model) -> None:
    try:
        assert type(model).pdl is False and model.pdl is False  # off until the engine turns it on
        model.set_pdl(True)
        assert {m.pdl for m in model.modules()} == {True}
        model.set_pdl(False)
        assert {m.pdl for m in model.modules()} == {False}
    finally:
        model.set_pdl(False)


@pytest.mark.parametrize("on", [True, False])
def test_every_kernel_call_gets_the_switch(model, calls, monkeypatch, on: bool) -> None:
    ids = torch.randint(3, 1000, (9,), generator=torch.Generator().manual_seed(0))
    model.set_pdl(on)
    try:
        _logits(model, ids)
        # where the fused rope kernel would run (Triton on CUDA), Rope calls apply_rope_at instead
        monkeypatch.setattr(attention, "rope_at_uses_kernel", lambda *a, **kw: True)
        _logits(model, ids)
        # the tiny model's grouped output projection straddles scale blocks (decoded per call): a whole-block one
        g = linear.Linear(32, 4 * 32, torch.float32)
        g.use_checkpoint_format("f8_e4m3", "f8_e8m0", (32, 32))
        g.weight.data.zero_()
        g.scale.data.fill_(1.0)
        g.pdl = on
        g.grouped(torch.randn(2, 4, 32), 4)
    finally:
        model.set_pdl(False)
    reached = {(m, n) for m, n, _ in calls}
    assert reached == {(_short(m), n) for m, n in SITES}, reached
    assert {pdl for _, _, pdl in calls} == {on}, calls


def test_logits_do_not_depend_on_pdl(model) -> None:
    ids = torch.randint(3, 1000, (11,), generator=torch.Generator().manual_seed(1))
    try:
        model.set_pdl(False)
        off = _logits(model, ids)
        model.set_pdl(True)
        on = _logits(model, ids)
    finally:
        model.set_pdl(False)
    assert torch.equal(on, off)
