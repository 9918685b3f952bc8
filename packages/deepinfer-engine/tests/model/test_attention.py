"""Attention pieces against direct transcriptions of the spec (docs/model.md §A.4-§A.7): V4 CSA overlapping
compressor, HCA compressor, indexer causality, window masks (causal and DSpark non-causal), RoPE per layer kind."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.attention import Attention
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext
from deepinfer_engine.model.presets import tiny_v4_config
from deepinfer_kernels.norm_rope import apply_rope, rms_norm, rope_cos_sin
from equality import init_random_


@pytest.fixture(scope="module")
def args() -> ModelArgs:
    return ModelArgs.from_config_dict(tiny_v4_config())


def _attn(args, layer: int) -> Attention:
    a = Attention(args, args.plan(layer), torch.float32)
    init_random_(a, seed=layer)
    return a


def _run_compressed(attn, args, x, chunks):
    """Feed x [n, d] in chunks through attn._compressed; return the final CompressedView and selections."""
    cache, bt = ModelCache.allocate_dense(args, [x.shape[0]], dtype=torch.float32)
    s, sels = 0, []
    for c in chunks:
        batch = ForwardBatch.single(torch.zeros(c, dtype=torch.int64), start_pos=s, block_table=bt[0])
        ctx = ForwardContext.build(batch, cache)
        qr = attn.q_norm(attn.wq_a(x[s : s + c]))
        sels.append(attn._compressed(x[s : s + c], qr, ctx))
        s += c
    return ctx.compressed[attn.layer_id], sels, ctx


def _naive_entries(comp, x, ratio, overlap, rope, eps):
    """docs/model.md §A.6 / docs/model.md §A.7 written out per window and channel."""
    a = x.float() @ comp.wkv.weight.float().T
    z = x.float() @ comp.wgate.weight.float().T
    z = z + comp.ape[torch.arange(x.shape[0]) % ratio]
    width = comp.width
    out = []
    for w in range(x.shape[0] // ratio):
        cur = slice(ratio * w, ratio * w + ratio)
        if overlap:
            ca, cz = [a[cur, width:]], [z[cur, width:]]
            if w > 0:
                prev = slice(ratio * (w - 1), ratio * w)
                ca.insert(0, a[prev, :width])
                cz.insert(0, z[prev, :width])
            A, Z = torch.cat(ca), torch.cat(cz)
        else:
            A, Z = a[cur], z[cur]
        pooled = (torch.softmax(Z, dim=0) * A).sum(0)
        lat = rms_norm(pooled[None], comp.norm.weight, eps)
        cos, sin = rope_cos_sin(torch.tensor([ratio * w]), rope.freqs)
        out.append(apply_rope(lat, cos, sin)[0])
    return torch.stack(out)


@pytest.mark.parametrize("layer,overlap", [(1, True), (2, False)])
def test_v4_compressor_matches_spec(args, layer, overlap):
    attn = _attn(args, layer)
    r = args.compress_ratios[layer]
    x = torch.randn(27, args.hidden_size, generator=torch.Generator().manual_seed(3))
    want = _naive_entries(attn.compressor, x, r, overlap, attn.rope, args.rms_norm_eps)
    for chunks in ([27], [1] * 27, [5, 3, 11, 8]):
        view, _, _ = _run_compressed(attn, args, x, chunks)
        assert view.seq_counts == (27 // r,)
        torch.testing.assert_close(view.kv, want, rtol=1e-5, atol=1e-5)


def test_v4_indexer_keys_and_topk_are_causal(args):
    attn = _attn(args, 3)  # CSA
    x = torch.randn(30, args.hidden_size, generator=torch.Generator().manual_seed(4))
    want_keys = _naive_entries(attn.indexer.compressor, x, 4, True, attn.rope, args.rms_norm_eps)
    view, sels, ctx = _run_compressed(attn, args, x, [30])
    torch.testing.assert_close(view.index_keys, want_keys, rtol=1e-5, atol=1e-5)
    sel = ctx.topk[3]  # [30, topk] per-sequence entry ids
    t = torch.arange(30)[:, None]
    assert bool(((sel < 0) | (sel < (t + 1) // 4)).all())  # never a future entry
    n_valid = (sel >= 0).sum(-1)
    assert n_valid.tolist() == torch.clamp((torch.arange(30) + 1) // 4, max=args.index_topk).tolist()


def test_hca_selects_every_visible_entry(args):
    attn = _attn(args, 2)
    x = torch.randn(20, args.hidden_size, generator=torch.Generator().manual_seed(5))
    _, sels, _ = _run_compressed(attn, args, x, [20])
    idx = sels[0].indices
    for t in range(20):
        assert sorted(i for i in idx[t].tolist() if i >= 0) == list(range((t + 1) // 8))


def test_window_indices_causal_and_noncausal(args):
    attn = _attn(args, 0)
    W = args.sliding_window
    cache, bt = ModelCache.allocate_dense(args, [20], dtype=torch.float32)
    kv = torch.arange(20.0)[:, None].expand(20, args.head_dim).contiguous()  # kv row value = its position
    ctx = ForwardContext.build(ForwardBatch.single(torch.zeros(12, dtype=torch.int64), block_table=bt[0]), cache)
    pool, idx = attn._window(kv[:12], ctx)
    for t in range(12):
        seen = sorted(int(pool[i, 0]) for i in idx[t].tolist() if i >= 0)
        assert seen == list(range(max(0, t - W + 1), t + 1))
    # DSpark draft mode: block of 3 at positions 12..14 sees context [12-W, 12) + the whole block, no write
    ctx = ForwardContext.build(
        ForwardBatch.single(torch.zeros(3, dtype=torch.int64), start_pos=12, block_table=bt[0]), cache,
        block_noncausal=True,
    )
    before = cache.swa[0].clone()
    pool, idx = attn._window(kv[12:15], ctx)
    for t in range(3):
        assert sorted(int(pool[i, 0]) for i in idx[t].tolist() if i >= 0) == list(range(12 - W, 15))
    assert torch.equal(cache.swa[0], before)


def test_rope_kind_per_layer(args):
    swa, csa = _attn(args, 0), _attn(args, 1)
    i = torch.arange(0, args.qk_rope_head_dim, 2, dtype=torch.float64)
    torch.testing.assert_close(swa.rope.freqs.double(), 10000.0 ** (-i / args.qk_rope_head_dim))
    plain = 160000.0 ** (-i / args.qk_rope_head_dim)
    # YaRN with original length 32: the highest pair is fully interpolated (divided by factor 16)
    assert torch.isclose(csa.rope.freqs[-1].double(), plain[-1] / 16)
    assert not torch.allclose(csa.rope.freqs.double(), plain)


def test_rope_tables_are_shared_per_positions_tensor_and_kind(args):
    """Rope.cos_sin with a per-forward table: the same positions tensor of one rope kind computes cos/sin once;
    another tensor with equal values, or another kind, computes its own; the values equal the untabled ones."""
    swa, swa2, csa = _attn(args, 0), Attention(args, args.plan(0), torch.float32), _attn(args, 1)  # two ropes of a kind
    assert swa.rope.key == swa2.rope.key != csa.rope.key
    pos = torch.tensor([3, 17, 40])
    tables: dict = {}
    c1, s1 = swa.rope.cos_sin(pos, tables)
    c2, s2 = swa2.rope.cos_sin(pos, tables)
    assert c2 is c1 and s2 is s1
    c3, _ = swa.rope.cos_sin(pos.clone(), tables)
    assert c3 is not c1 and torch.equal(c3, c1)
    c4, _ = csa.rope.cos_sin(pos, tables)
    assert not torch.equal(c4, c1)
    want = rope_cos_sin(pos, swa.rope.freqs)
    assert torch.equal(c1, want[0]) and torch.equal(s1, want[1])
    x = torch.randn(3, args.num_attention_heads, args.head_dim)
    assert torch.equal(swa.rope_fn(None)(x, pos), swa.rope(x, pos, tables=tables))
