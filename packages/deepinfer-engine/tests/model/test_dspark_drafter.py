"""StageDrafter: the DSpark stages behind deepinfer-dspark's DraftModel; greedy speculation through propose /
verify emits exactly the plain greedy decode (fp32 CPU, tiny V4.1 checkpoint, no engine loop)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_dspark import DraftModel, propose, verify
from deepinfer_engine.errors import InputError
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.dspark_drafter import StageDrafter
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.model.loader import load_model
from deepinfer_engine.model.model import Transformer
from engine_testing import make_tiny_checkpoint

PROMPTS = torch.tensor([[11, 250, 3004, 77, 9, 1200], [5, 5, 6000, 42, 17, 300]], dtype=torch.int64)
NEW_TOKENS = 7


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("drafter") / "ckpt", arch="v41", seed=3)
    return load_model(ckpt, torch.float32, quantized=False).eval()


def _batch(seqs: list[torch.Tensor], starts: torch.Tensor, bt: torch.Tensor, slots: torch.Tensor) -> ForwardBatch:
    """Sequence b = seqs[b] at positions starts[b].. in cache slot slots[b]; logits of every row."""
    ids = torch.cat(seqs)
    pos = torch.cat([int(s) + torch.arange(t.numel()) for s, t in zip(starts.tolist(), seqs)])
    return ForwardBatch(
        input_ids=ids, positions=pos, query_lens=tuple(t.numel() for t in seqs), slots=tuple(slots.tolist()),
        block_tables=bt[slots], logits_indices=torch.arange(ids.numel()),
    )  # fmt: skip


def _greedy_reference(model: Transformer) -> torch.Tensor:
    b, p = PROMPTS.shape
    cache, bt = ModelCache.allocate_dense(model.args, [p + NEW_TOKENS + 1] * b, dtype=torch.float32)
    slots = torch.arange(b)
    out = model.forward_features(_batch(list(PROMPTS), torch.zeros(b, dtype=torch.int64), bt, slots), cache)
    tok = out.logits.view(b, p, -1)[:, -1].argmax(-1)
    toks = [tok]
    for i in range(NEW_TOKENS - 1):
        out = model.forward_features(_batch(list(tok[:, None]), torch.full((b,), p + i), bt, slots), cache)
        tok = out.logits.argmax(-1)
        toks.append(tok)
    return torch.stack(toks, 1)


class _Steered:
    """A StageDrafter whose first `depth` drafts per block are pushed onto the reference continuation (so that
    drafts get accepted: random weights alone accept none), through the adapter's real parallel pass."""

    def __init__(self, inner: StageDrafter, ref: torch.Tensor, prompt_len: int, depth: int) -> None:
        self.inner, self.ref, self.prompt_len, self.depth = inner, ref, prompt_len, depth
        self.block_size, self.heads = inner.block_size, inner.heads

    def draft_block(self, anchor_ids: torch.Tensor, anchor_positions: torch.Tensor):
        blk = self.inner.draft_block(anchor_ids, anchor_positions)
        u = blk.base_logits.clone()
        for b, pos in enumerate(anchor_positions.tolist()):
            for j in range(min(self.depth, self.block_size)):
                k = pos - self.prompt_len + 1 + j  # index in ref of the token draft j predicts
                if k < self.ref.shape[1]:
                    u[b, j, self.ref[b, k]] += 1e4
        return type(blk)(base_logits=u, hidden=blk.hidden)


def _greedy_speculative(
    model: Transformer, ref: torch.Tensor | None = None, depth: int = 0
) -> tuple[torch.Tensor, int]:
    """Speculative greedy decode (verify every draft); returns (tokens [B, NEW_TOKENS], drafts accepted).
    With `ref`, the first `depth` drafts of each block are steered onto it (_Steered)."""
    a = model.args
    n, tids = a.dspark_block_size, tuple(a.dspark_target_layer_ids)
    b, p = PROMPTS.shape
    cache, bt = ModelCache.allocate_dense(a, [p + NEW_TOKENS + n + 2] * b, dtype=torch.float32)
    drafter = StageDrafter(model, cache, bt)
    assert isinstance(drafter, DraftModel)
    proposer = drafter if ref is None else _Steered(drafter, ref, p, depth)
    slots = torch.arange(b)
    prefill = _batch(list(PROMPTS), torch.zeros(b, dtype=torch.int64), bt, slots)
    out = model.forward_features(prefill, cache, capture=tids)
    drafter.insert_context(prefill, out.features)
    anchor = out.logits.view(b, p, -1)[:, -1].argmax(-1)
    pos = torch.full((b,), p, dtype=torch.int64)
    emitted: list[list[int]] = [[int(t)] for t in anchor]
    accepted = 0
    while min(len(e) for e in emitted) < NEW_TOKENS:
        prop = propose(proposer, anchor, pos)
        m = torch.full((b,), n, dtype=torch.int64)
        seq = torch.cat([anchor[:, None], prop.draft_ids], 1)
        out = model.forward_features(_batch(list(seq), pos, bt, slots), cache, capture=tids)
        res = verify(out.logits, prop, m, greedy=True)
        acc = res.num_accepted
        accepted += int(acc.sum())
        keep = torch.cat([k * (n + 1) + torch.arange(int(acc[k]) + 1) for k in range(b)])
        ctx = _batch([seq[k, : int(acc[k]) + 1] for k in range(b)], pos, bt, slots)
        drafter.insert_context(ctx, {lid: f[keep] for lid, f in out.features.items()})
        for k in range(b):
            emitted[k] += res.output_ids[k, : int(acc[k]) + 1].tolist()
        anchor = res.next_anchors()
        pos = pos + acc + 1
    return torch.tensor([e[:NEW_TOKENS] for e in emitted]), accepted


@pytest.fixture(scope="module")
def reference(model: Transformer) -> torch.Tensor:
    return _greedy_reference(model)


@pytest.mark.parametrize("depth", [None, 2, 99])
def test_greedy_speculation_reproduces_greedy_decode(
    model: Transformer, reference: torch.Tensor, depth: int | None
) -> None:
    """None: the stages' own drafts (random weights: none accepted); 2: two accepted per round, then a rejection;
    99: every draft accepted (bonus tokens). The emitted tokens equal the plain greedy decode in every case."""
    spec, accepted = _greedy_speculative(model, None if depth is None else reference, depth or 0)
    assert torch.equal(spec, reference), f"speculative {spec.tolist()} != greedy {reference.tolist()}"
    if depth:
        assert accepted >= PROMPTS.shape[0] * min(depth, model.args.dspark_block_size)


def test_draft_block_shapes_and_slot_check(model: Transformer) -> None:
    a = model.args
    cache, bt = ModelCache.allocate_dense(a, [32, 32], dtype=torch.float32)
    drafter = StageDrafter(model, cache, bt, sts=2.0)
    assert drafter.block_size == a.dspark_block_size and drafter.heads.sts == 2.0
    blk = drafter.draft_block(torch.tensor([1, 2]), torch.tensor([0, 3]))
    assert blk.base_logits.shape == (2, a.dspark_block_size, a.vocab_size)
    assert blk.hidden.shape == (2, a.dspark_block_size, a.hidden_size)
    drafter.slots = torch.tensor([1])
    with pytest.raises(InputError, match="slots"):
        drafter.draft_block(torch.tensor([1, 2]), torch.tensor([0, 3]))


def test_model_without_dspark_stages_is_refused(model: Transformer) -> None:
    bare = Transformer(model.args, torch.float32, with_draft=False)
    cache, bt = ModelCache.allocate_dense(model.args, [8], dtype=torch.float32)
    with pytest.raises(InputError, match="no DSpark draft stages"):
        StageDrafter(bare, cache, bt)


def test_slots_map_rows_to_their_requests(model: Transformer) -> None:
    """Row b drafts from the rings of cache slot slots[b]: the two requests in reverse order give the reversed
    blocks, and a request's block does not depend on the other request's context."""
    a = model.args
    tids = tuple(a.dspark_target_layer_ids)
    b, p = PROMPTS.shape
    cache, bt = ModelCache.allocate_dense(a, [p + a.dspark_block_size + 2] * b, dtype=torch.float32)
    drafter = StageDrafter(model, cache, bt)
    prefill = _batch(list(PROMPTS), torch.zeros(b, dtype=torch.int64), bt, torch.arange(b))
    drafter.insert_context(prefill, model.forward_features(prefill, cache, capture=tids).features)
    anchors, pos = torch.tensor([7, 900]), torch.full((b,), p)
    fwd = drafter.draft_block(anchors, pos)
    drafter.slots = torch.tensor([1, 0])
    rev = drafter.draft_block(anchors.flip(0), pos)
    torch.testing.assert_close(rev.base_logits, fwd.base_logits.flip(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rev.hidden, fwd.hidden.flip(0), atol=1e-5, rtol=1e-5)
    drafter.slots = torch.tensor([1])
    one = drafter.draft_block(anchors[1:], pos[1:])
    torch.testing.assert_close(one.base_logits[0], fwd.base_logits[1], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(fwd.base_logits[0], fwd.base_logits[1])  # different anchors and contexts: a real check
