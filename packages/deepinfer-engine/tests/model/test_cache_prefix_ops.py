"""Prefix-cache tensor ops of ModelCache: a state block captured inside a forward at a page boundary, restored
into another slot with a copy of the pages below it, continues exactly like the original sequence (plain
storage on V4.1 and V4, and V4.1's deployed record storage); page copies and host-tier round trips are bitwise."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.engram_hash import synthetic_token_map
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_config, tiny_v41_config
from equality import init_random_, max_rel_err


def _args(kind: str) -> ModelArgs:
    if kind == "v4":
        return ModelArgs.from_config_dict(tiny_v4_config())
    cfg = tiny_v41_config()
    if kind == "v41-records":
        cfg["text_config"]["index_head_dim"] = 32  # MXFP4 keys need a multiple of 32 channels
    return ModelArgs.from_config_dict(cfg)


@torch.no_grad()
@pytest.mark.parametrize("kind", ["v41", "v4", "v41-records"])
def test_captured_state_block_resumes_exactly(kind: str) -> None:
    a = _args(kind)
    model = init_random_(Transformer(a, torch.float32, with_draft=False), seed=3)
    if a.arch == "v41":
        model.set_engram_token_map(synthetic_token_map(a.vocab_size, a.engram_compressed_vocab_size))
    P, n, b = 16, 37, 32  # capture at the second page boundary, inside one 37-token forward
    ids = torch.randint(3, a.vocab_size, (n,), generator=torch.Generator().manual_seed(1))
    cache = ModelCache.allocate(a, num_slots=3, num_pages=6, page_size=P, dtype=torch.float32,
                                kv_cache_dtype="auto" if kind == "v41-records" else "bfloat16")
    cache.arm_capture(0, b, 2)
    cache.arm_capture(0, 48, 1)  # beyond this forward: dropped (captures are armed for one forward)
    before = cache.swa[0][1].clone()
    full = model(ForwardBatch.single(ids, block_table=torch.tensor([0, 1, 2])), cache)
    assert cache.captures == {} and torch.equal(cache.swa[0][1], before)
    cache.copy_pages([(0, 3), (1, 4)])  # the pages below the boundary (a hit would share them)
    cache.clone_slot(2, 1, b)  # restore the state block into a fresh slot
    cache.set_token_history(1, b, ids[b - 8 : b].tolist())
    rest = model(ForwardBatch.single(ids[b:], start_pos=b, slot=1, block_table=torch.tensor([3, 4, 5])), cache)
    assert max_rel_err(rest, full[b:]) < 1e-5
    # without the state block the same resume reads the fresh slot's empty rings: different numbers
    cache.reset_slot(1)
    cache.high_water[1] = b
    cache.set_token_history(1, b, ids[b - 8 : b].tolist())
    wrong = model(ForwardBatch.single(ids[b:], start_pos=b, slot=1, block_table=torch.tensor([3, 4, 5])), cache)
    assert max_rel_err(wrong, full[b:]) > 1e-3


def test_page_copy_and_host_tier_round_trip_are_bitwise() -> None:
    a = _args("v41")
    cache = ModelCache.allocate(a, num_slots=1, num_pages=4, page_size=16, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    for _, t in cache._paged_stores():
        t.copy_(torch.randn(t.shape, generator=g))
    before = {k: t.clone() for k, t in cache._paged_stores()}
    cache.allocate_host_pages(2)
    cache.offload_pages([(1, 0), (2, 1)])
    for _, t in cache._paged_stores():
        t[1:3].zero_()
    cache.load_pages([(1, 1), (0, 2)])  # swapped back: host page 1 held page 2
    cache.copy_pages([(0, 3)])
    for k, t in cache._paged_stores():
        assert torch.equal(t[1], before[k][2]) and torch.equal(t[2], before[k][1]) and torch.equal(t[3], before[k][0])
    assert cache.host_tier_bytes_per_page() == sum(t[0].numel() * 4 for _, t in cache._paged_stores())


@torch.no_grad()
@pytest.mark.parametrize("kind", ["v41", "v4"])
def test_approximate_replay_floors_hide_the_slot_and_spare_the_pages(kind: str) -> None:
    """With the floors set, a replay from s = h - W reads nothing of what its slot held before (garbage or
    zeros give the same logits) and writes no compressed entry of the shared pages below h."""
    a = _args(kind)
    model = init_random_(Transformer(a, torch.float32, with_draft=False), seed=3)
    if a.arch == "v41":
        model.set_engram_token_map(synthetic_token_map(a.vocab_size, a.engram_compressed_vocab_size))
    P, n, h = 16, 40, 32
    s = h - a.sliding_window
    ids = torch.randint(3, a.vocab_size, (n,), generator=torch.Generator().manual_seed(2))
    cache = ModelCache.allocate(a, num_slots=3, num_pages=8, page_size=P, dtype=torch.float32)
    full = model(ForwardBatch.single(ids, block_table=torch.tensor([0, 1, 2])), cache)
    shared = {k: t[:2].clone() for k, t in cache._paged_stores()}
    g = torch.Generator().manual_seed(9)
    outs = []
    for slot, tail, fill in ((1, 5, "garbage"), (2, 6, "zeros")):
        for t in cache._slot_stores():
            t[slot].copy_(torch.randn(t[slot].shape, generator=g) * 5 if fill == "garbage" else torch.zeros_like(t[slot]))
        cache.set_floors(slot, s, h)
        cache.set_token_history(slot, s, ids[s - 8 : s].tolist())
        outs.append(model(ForwardBatch.single(ids[s:], start_pos=s, slot=slot,
                                              block_table=torch.tensor([0, 1, tail])), cache))
    assert torch.equal(outs[0], outs[1])
    assert all(torch.equal(t[:2], shared[k]) for k, t in cache._paged_stores())
    assert max_rel_err(outs[0][h - s :], full[h:]) > 0  # the floored window is an approximation
