"""Engram injection (docs/model.md §C.6): gate formula on hand cases, image positions, history plumbing for decode."""

from __future__ import annotations

import math

import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.engram import Engram, engram_gate, engram_row_ids
from deepinfer_engine.model.engram_hash import EngramHasher, synthetic_token_map
from deepinfer_engine.model.presets import tiny_v41_config


def _sig(v: float) -> float:
    return 1.0 / (1.0 + math.exp(-v))


def test_engram_gate_hand_case() -> None:
    # d = 4, 3 streams (T=1).
    r = torch.tensor([[[1.0, 1.0, 1.0, 1.0], [2.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]])
    key = torch.tensor([[[1.0, 1.0, 1.0, 1.0], [-1.0, 0.0, 0.0, 0.0], [1.0, -1.0, 1.0, -1.0]]])
    qw = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.5, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    kw = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    got = engram_gate(r, key, qw, kw, eps=1e-20)
    # stream 0: dot 4, rms(r)=1, rms(key)=1 -> g = 4/sqrt(4) = 2 -> sigmoid(sqrt 2)
    # stream 1: dot 2*0.5*(-1) = -1; mean(r²) = 1 -> rsqrt 1; mean(key²) = 1/4 -> rsqrt 2; g = -1*2/2 = -1
    #           -> sigmoid(-1)
    # stream 2: dot +0 -> g = +0 -> copysign(sqrt(max(0, 1e-6)), +0) = +1e-3 -> sigmoid(1e-3), not 0.5
    want = torch.tensor([[_sig(math.sqrt(2.0)), _sig(-1.0), _sig(1e-3)]])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got[0, 2].item() != 0.5


def test_engram_gate_zero_dot_is_positive_zero() -> None:
    # a zero dot accumulates from +0 (as the reference kernel's cleared accumulator), even over -0.0 products,
    # so g = +0 and the gate is sigmoid(+1e-3) in both rows
    r = torch.ones(1, 2, 4)
    key = torch.tensor([[[-0.0] * 4, [0.0] * 4]])
    got = engram_gate(r, key, torch.ones(2, 4), torch.ones(2, 4), eps=1e-20)
    torch.testing.assert_close(got, torch.full((1, 2), _sig(1e-3)), rtol=0, atol=1e-9)


def test_engram_gate_small_values_use_clamp() -> None:
    # g = 1e-8 (> 0) -> sqrt(max(1e-8, 1e-6)) = 1e-3 -> sigmoid(1e-3)
    r = torch.tensor([[[1.0, 1.0, 1.0, 1.0]]])
    key = torch.tensor([[[1.0, 1.0, 1.0, 1.0]]])
    qw = torch.full((1, 4), 0.5e-8)
    kw = torch.ones(1, 4)
    got = engram_gate(r, key, qw, kw, eps=1e-20)  # dot = 2e-8, g = 2e-8 / 2 = 1e-8
    torch.testing.assert_close(got, torch.tensor([[_sig(1e-3)]]), rtol=0, atol=1e-9)


def test_engram_forward_adds_gated_value_and_zero_at_images() -> None:
    torch.manual_seed(0)
    args = ModelArgs.from_config_dict(tiny_v41_config())
    d, hc, lookups = args.hidden_size, args.hc_mult, args.engram_num_ngram_heads
    m = Engram(
        dim=d,
        hc_mult=hc,
        num_embeddings=args.engram_num_embeddings[0],
        head_dim=args.engram_head_dim,
        num_lookups=lookups,
        eps=args.rms_norm_eps,
    )
    assert m.embed.weight.shape == (args.engram_num_embeddings[0], args.engram_head_dim)
    assert m.wkv.weight.shape == ((hc + 1) * d, lookups * args.engram_head_dim)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_()
    r = torch.randn(3, hc, d)
    rows = torch.randint(0, args.engram_num_embeddings[0], (3, lookups))
    img = torch.tensor([False, True, False])
    out = m(r, rows, img)
    e = m.embed.weight[rows].reshape(3, -1)
    kv = (e @ m.wkv.weight.T).view(3, hc + 1, d)
    gate = engram_gate(r, kv[:, :hc], m.q_weight, m.k_weight, 1e-20)
    want = r + gate[..., None] * kv[:, hc][:, None, :]
    torch.testing.assert_close(out[[0, 2]], want[[0, 2]])
    assert torch.equal(out[1], r[1])  # gate 0 at image positions


def test_row_ids_from_history_match_full_sequence_and_break_at_images() -> None:
    args = ModelArgs.from_config_dict(tiny_v41_config())
    tmap = synthetic_token_map(args.vocab_size, args.engram_compressed_vocab_size)
    hasher = EngramHasher.from_args(args, tmap)
    img = args.vocab_size  # image ids lie past the vocabulary
    seq = torch.tensor([5, 17, 33, img, img, 40, 41, 42, 7, 9], dtype=torch.int64)
    maxn = args.engram_max_ngram_size

    def history(ids: torch.Tensor, start: int, n: int) -> torch.Tensor:
        out = torch.full((n, maxn), -1, dtype=torch.int64)
        for j in range(n):
            p = start + j
            for s in range(maxn):
                if p - (maxn - 1) + s >= 0:
                    out[j, s] = ids[p - (maxn - 1) + s]
        return out

    full = engram_row_ids(hasher, seq, (10,), history(seq, 0, 10))
    # decode in chunks (3, 1, 6) as two sequences batched with a second one
    other = torch.tensor([3, 4], dtype=torch.int64)
    parts = []
    for start, n in ((0, 3), (3, 1), (4, 6)):
        ids = torch.cat([seq[start : start + n], other])
        hist = torch.cat([history(seq, start, n), history(other, 0, 2)])
        parts.append(engram_row_ids(hasher, ids, (n, 2), hist)[:n])
    assert torch.equal(torch.cat(parts), full)
    # token 5 (id 40) follows an image: its n-grams are blocked like at a sequence start
    alone = engram_row_ids(hasher, seq[5:6], (1,), history(seq[5:6], 0, 1))
    assert torch.equal(full[5], alone[0])
    assert not torch.equal(full[6], engram_row_ids(hasher, seq[6:7], (1,), history(seq[6:7], 0, 1))[0])
