"""Side streams of decode-sized steps (model/overlap.py), on the CPU: with the fork / join recorded instead of run
on CUDA streams, every MoE layer's shared expert and every Engram projection goes through the side path, each
Engram projection is started one layer ahead and joined by its own layer, and the logits are bit-identical to the
forward without side streams (the same ops on the same inputs)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.model import attention as attention_mod
from deepinfer_engine.model import block as block_mod
from deepinfer_engine.model import moe as moe_mod
from deepinfer_engine.model.loader import load_model
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.overlap import OVERLAP_MAX_TOKENS, Overlapped, SideStreams
from equality import run_batched, run_chunked


class _Recorder:
    """Stands in for overlap.run_beside / join on the CPU: runs the work inline, records the order of events."""

    def __init__(self) -> None:
        self.events: list[tuple[str, object]] = []

    def run_beside(self, stream: object, fn, *args):  # noqa: ANN001, ANN202
        name = {"shared": "shared", "prefetch": "engram", "query": "query"}[stream]
        self.events.append((f"start {name}", getattr(fn, "__self__", None)))
        return Overlapped(fn(*args), None)  # done=None: wait_shared / join wait for nothing on the CPU

    def join(self, work: Overlapped) -> object:
        self.events.append(("join", None))
        return work.value


@pytest.fixture(scope="module")
def model(tiny_ckpt) -> Transformer:
    return load_model(tiny_ckpt("v41"), dtype=torch.float32, device="cpu")


def _with_side_path(monkeypatch: pytest.MonkeyPatch, m: Transformer) -> _Recorder:
    rec = _Recorder()
    fake = SideStreams(torch.device("cpu"), "shared", "prefetch", "query")  # type: ignore[arg-type]
    small = lambda batch: fake if batch.num_tokens <= OVERLAP_MAX_TOKENS else None  # noqa: E731
    monkeypatch.setattr(m, "_side_streams", small)
    monkeypatch.setattr(moe_mod, "run_beside", rec.run_beside)
    monkeypatch.setattr(block_mod, "run_beside", rec.run_beside)
    monkeypatch.setattr(block_mod, "join", rec.join)
    monkeypatch.setattr(attention_mod, "run_beside", rec.run_beside)
    monkeypatch.setattr(attention_mod, "join", rec.join)
    return rec


def test_side_path_is_taken_and_changes_no_logit(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = torch.randint(3, 1000, (21,), generator=torch.Generator().manual_seed(0))
    chunks = [9, 1, 1, 4, 1, 5]
    ref = run_chunked(model, ids, chunks)
    rec = _with_side_path(monkeypatch, model)
    got = run_chunked(model, ids, chunks)
    assert torch.equal(got, ref)

    engram_layers = [b for b in model.layers if b.engram is not None]
    assert engram_layers and engram_layers[0].layer_id > 0  # the tiny V4.1 config has Engram at layers 1 and 3
    shared = [e for e in rec.events if e[0] == "start shared"]
    assert len(shared) == len(chunks) * len(model.layers)  # every layer's shared expert, every step
    starts = [e for e in rec.events if e[0] == "start engram"]
    assert len(starts) == len(chunks) * len(engram_layers)
    assert {e[1] for e in starts} == {b.engram for b in engram_layers}
    queries = [e for e in rec.events if e[0] == "start query"]
    assert len(queries) == len(chunks) * len(model.layers)  # every layer's query projection, every step
    # every side start is joined (shared experts join inside the combine: not recorded here); an Engram
    # projection is joined only after the previous layer's shared expert started (it ran beside that layer),
    # a query projection right after its own layer's KV path
    kinds = [k for k, _ in rec.events if k != "start shared"]
    assert kinds.count("join") == len(starts) + len(queries)
    for i, k in enumerate(rec.events):
        if k[0] == "start engram":
            nxt = next(j for j in range(i + 1, len(rec.events)) if rec.events[j][0] == "join"
                       and rec.events[j - 1][0] != "start query")  # fmt: skip
            assert any(e[0] == "start shared" for e in rec.events[i:nxt])


def test_batched_varlen_with_side_path_equals_without(model: Transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 1000, (n,), generator=g) for n in (13, 5, 22)]
    ref = run_batched(model, seqs, seed=3)
    _with_side_path(monkeypatch, model)
    got = run_batched(model, seqs, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_no_side_streams_on_cpu_or_when_off(model: Transformer) -> None:
    from deepinfer_engine.model.forward_batch import ForwardBatch

    batch = ForwardBatch.single(torch.arange(3, 8), block_table=None)
    assert model._side_streams(batch) is None  # CPU: the plain single-stream forward
    model.set_overlap(False)
    try:
        assert model.overlap is False and model._side_streams(batch) is None
    finally:
        model.set_overlap(True)
