"""Tiny V4.1 (§9.2): full forward == token-by-token decode == random chunked prefill == batched varlen.

Covers every CSA2 mode of the tiny layout (0,1 SWA (1 + Engram); 2 Full r2; 3 Reuse r2 + Engram; 4 Full r2;
5 Full r1 + candidate publisher; 6 Reuse r1; 7 Reindex + candidate filter), delayed mHC and image-token ids
(bias_vl routing, Engram gate 0, n-grams broken). Tolerance: fp32, max |Δ| / max |ref| <= 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.model.model import Transformer
from equality import max_rel_err, run_batched, run_chunked, run_full

TOL = 1e-5


@pytest.fixture(scope="module")
def model(make_tiny_v41_model) -> Transformer:
    return make_tiny_v41_model(seed=11)


def _seqs(model: Transformer) -> list[torch.Tensor]:
    a = model.args
    g = torch.Generator().manual_seed(3)
    s0 = torch.randint(3, 500, (21,), generator=g)
    s1 = torch.randint(3, 500, (15,), generator=g)
    s1[4:8] = a.vocab_size  # an image span in the middle (image ids lie past the vocabulary)
    s1[8] = a.image_token_id  # the config's image_token_id is an ordinary text id
    s2 = torch.randint(3, 500, (6,), generator=g)
    s2[0] = a.vocab_size + 2  # any id of [vocab, vocab + 5) counts as an image position
    return [s0, s1, s2]


def test_decode_equals_full(model: Transformer) -> None:
    s1 = _seqs(model)[1]
    full = run_full(model, s1)
    dec = run_chunked(model, s1, [1] * s1.numel())
    err = max_rel_err(dec, full)
    print(f"v41 decode vs full: max rel err {err:.3g}")
    assert err <= TOL


def test_random_chunks_equal_full(model: Transformer) -> None:
    s0 = _seqs(model)[0]
    full = run_full(model, s0)
    for chunks in ([3, 1, 4, 1, 5, 7], [2, 9, 10]):  # odd boundaries hit the ratio-2 ring
        got = run_chunked(model, s0, chunks)
        err = max_rel_err(got, full)
        print(f"v41 chunks {chunks}: max rel err {err:.3g}")
        assert err <= TOL


def test_batched_varlen_equals_full(model: Transformer) -> None:
    seqs = _seqs(model)
    fulls = [run_full(model, s) for s in seqs]
    outs = run_batched(model, seqs, seed=5, max_chunk=6)
    for i, (o, f) in enumerate(zip(outs, fulls)):
        err = max_rel_err(o, f)
        print(f"v41 batched seq {i}: max rel err {err:.3g}")
        assert err <= TOL


def test_image_ids_change_the_output(model: Transformer) -> None:
    """Sanity: the image-sentinel path is live (bias_vl routing / Engram gate 0 make image ids matter
    differently from an ordinary id with the same embedding)."""
    s1 = _seqs(model)[1]
    plain = s1.clone()
    plain[4:8] = 7
    with torch.no_grad():
        emb = model.embed.weight
        saved = emb[7].clone()
        emb[7] = 0.0  # image ids embed as 0: same embedding, only the id-dependent paths differ
        try:
            diff = (run_full(model, plain) - run_full(model, s1))[4:].abs().max()
        finally:
            emb[7] = saved
    assert float(diff) > 1e-3


def test_rejected_speculative_tail_is_overwritten(model: Transformer) -> None:
    """Rollback by position: after a forward over a rejected tail, re-running from the rollback point with the
    real tokens reproduces the full forward (ratio-2 ring, compressed entries, index keys, token ring, SWA)."""
    from deepinfer_engine.model.cache import ModelCache
    from deepinfer_engine.model.forward_batch import ForwardBatch

    s0 = _seqs(model)[0]
    n = s0.numel()
    full = run_full(model, s0)
    cache, bt = ModelCache.allocate_dense(model.args, [n + 8], dtype=torch.float32)
    outs = []
    with torch.no_grad():
        for start, stop, junk in ((0, 7, 6), (7, 12, 5), (12, n, 0)):  # rollback points 7 (odd) and 12 (even)
            if junk:
                bad = torch.randint(3, 500, (junk,), generator=torch.Generator().manual_seed(start))
                model(ForwardBatch.single(torch.cat([s0[start : start + 1], bad]), start_pos=start,
                                          block_table=bt[0]), cache)  # fmt: skip
            outs.append(model(ForwardBatch.single(s0[start:stop], start_pos=start, block_table=bt[0]), cache))
            # a verify-style step that is only partly accepted: run junk after `stop`, keep nothing of it
            if stop < n:
                tail = torch.randint(3, 500, (3,), generator=torch.Generator().manual_seed(stop))
                model(ForwardBatch.single(tail, start_pos=stop, block_table=bt[0]), cache)
    err = max_rel_err(torch.cat(outs), full)
    print(f"v41 rollback: max rel err {err:.3g}")
    assert err <= TOL
