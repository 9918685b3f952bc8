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
    """Stands in for overlap.run_beside / join on the CPU: runs the work inline and records ("start", kind, n) and
    ("join", kind, n) events, n numbering the side works."""

    KINDS = {"shared": "shared", "prefetch": "engram", "query": "query", "mix": "mix"}

    def __init__(self) -> None:
        self.events: list[tuple[str, str, int]] = []
        self._kind: dict[int, tuple[str, int]] = {}  # id(work) -> (kind, n); ids of freed works are reused
        self._n = 0

    def run_beside(self, stream: str, fn, *args):  # noqa: ANN001, ANN202
        n, self._n = self._n, self._n + 1
        self.events.append(("start", self.KINDS[stream], n))
        work = Overlapped(fn(*args), None)  # done=None: wait_shared / join wait for nothing on the CPU
        self._kind[id(work)] = (self.KINDS[stream], n)
        return work

    def join(self, work: Overlapped) -> object:
        self.events.append(("join", *self._kind[id(work)]))
        return work.value

    def between(self, n: int) -> list[tuple[str, str, int]]:
        """The events after side work n started and before it was joined."""
        i = next(i for i, e in enumerate(self.events) if e[0] == "start" and e[2] == n)
        j = next(j for j, e in enumerate(self.events) if e[0] == "join" and e[2] == n)
        assert i < j
        return self.events[i + 1 : j]


@pytest.fixture(scope="module")
def model(tiny_ckpt) -> Transformer:
    return load_model(tiny_ckpt("v41"), dtype=torch.float32, device="cpu")


def _with_side_path(monkeypatch: pytest.MonkeyPatch, m: Transformer) -> _Recorder:
    rec = _Recorder()
    fake = SideStreams(torch.device("cpu"), "shared", "prefetch", "query", "mix")  # type: ignore[arg-type]
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
    starts = [e for e in rec.events if e[0] == "start"]
    count = {k: sum(e[1] == k for e in starts) for k in _Recorder.KINDS.values()}
    steps, layers = len(chunks), len(model.layers)
    # every layer's shared expert and query projection, both sub-layers' mixes (delayed mHC), every step; the
    # Engram projections of the Engram layers
    assert count == {"shared": steps * layers, "query": steps * layers, "mix": 2 * steps * layers,
                     "engram": steps * len(engram_layers)}  # fmt: skip
    for kind, n in ((e[1], e[2]) for e in starts):
        if kind == "shared":
            continue  # joined inside the MoE combine (shared_ready), not through join
        ran = {e[1] for e in rec.between(n) if e[0] == "start"}
        if kind == "engram":
            assert "shared" in ran  # the previous layer's FFN ran while the projection was in flight
        if kind == "mix":
            assert ran & {"query", "shared"}  # the sub-layer (attention or FFN) ran beside its mixes


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
