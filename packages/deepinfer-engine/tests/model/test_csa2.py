"""CSA2 compressor / indexer / candidate filter (docs/model.md §C.3-C.4): hand cases and chunking invariants."""

from __future__ import annotations

import math

import pytest
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.csa2 import (
    Csa2Compressor,
    Csa2Indexer,
    Csa2Plan,
    compress_chunk,
    csa2_select,
    csa2_update_source,
    pool_ratio2,
    rms_norm,
)
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext
from deepinfer_engine.model.presets import tiny_v41_config


def test_pool_ratio2_hand_case() -> None:
    # one group, 2 channels. channel 0: z = (0, ln 3) -> weights (1/4, 3/4); a = (1, 5) -> 0.25 + 3.75 = 4.
    # channel 1: z = (2, 2) -> (1/2, 1/2); a = (3, 7) -> 5.
    a = torch.tensor([[[1.0, 3.0], [5.0, 7.0]]])
    z = torch.tensor([[[0.0, 2.0], [math.log(3.0), 2.0]]])
    got = pool_ratio2(a, z)
    torch.testing.assert_close(got, torch.tensor([[4.0, 5.0]]), rtol=0, atol=1e-6)


def test_compress_chunk_ratio2_groups_and_odd_start() -> None:
    g = torch.Generator().manual_seed(1)
    a, z = torch.randn(7, 3, generator=g), torch.randn(7, 3, generator=g)
    ids, pooled = compress_chunk(a, z, 0, 2, None, None)
    assert ids.tolist() == [0, 1, 2]  # token 6 opens group 3, not complete yet
    w = torch.softmax(z[2:4], dim=0)
    torch.testing.assert_close(pooled[1], (w * a[2:4]).sum(0))
    # a chunk starting at odd position 3 pools with the saved row of token 2
    ids2, pooled2 = compress_chunk(a[3:], z[3:], 3, 2, a[2], z[2])
    assert ids2.tolist() == [1, 2]
    torch.testing.assert_close(pooled2, pooled[1:])
    with pytest.raises(ValueError, match="odd position"):
        compress_chunk(a[3:], z[3:], 3, 2, None, None)


def test_compress_chunk_ratio1_emits_every_token() -> None:
    a = torch.arange(6.0).view(3, 2)
    ids, pooled = compress_chunk(a, None, 5, 1, None, None)
    assert ids.tolist() == [5, 6, 7]
    assert torch.equal(pooled, a)


# ---------------------------------------------------------------------------------------------- integration


def _rope(x: torch.Tensor, pos: torch.Tensor, dims: int = 8, theta: float = 1000.0) -> torch.Tensor:
    """Interleaved RoPE on the trailing `dims` channels (test stand-in; the model passes its compress RoPE)."""
    inv = theta ** (-torch.arange(0, dims, 2, dtype=torch.float32) / dims)
    ang = pos.float()[:, None] * inv[None, :]  # [T, dims/2]
    shape = [x.shape[0]] + [1] * (x.dim() - 2) + [dims // 2]
    cos, sin = ang.cos().view(shape), ang.sin().view(shape)
    out = x.clone()
    r = x[..., -dims:].float()
    a, b = r[..., 0::2], r[..., 1::2]
    rot = torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(-2)
    out[..., -dims:] = rot.to(x.dtype)
    return out


@pytest.fixture(scope="module")
def tiny() -> ModelArgs:
    return ModelArgs.from_config_dict(tiny_v41_config())


def _modules(
    args: ModelArgs, seed: int = 0
) -> dict[int, tuple[Csa2Plan, Csa2Compressor | None, Csa2Indexer | None]]:
    torch.manual_seed(seed)
    out = {}
    for p in args.layer_plans:
        if p.kind != "csa2":
            continue
        plan = Csa2Plan.from_layer_plan(p, args)
        comp = (
            Csa2Compressor(dim=args.hidden_size, head_dim=args.head_dim, ratio=p.ratio, eps=args.rms_norm_eps)
            if p.has_compressor
            else None
        )
        idx = None
        if p.has_indexer_k or p.has_indexer_q:
            idx = Csa2Indexer(
                dim=args.hidden_size,
                q_lora_rank=args.q_lora_rank,
                head_dim=args.head_dim,
                n_heads=args.index_n_heads,
                index_head_dim=args.index_head_dim,
                has_k=p.has_indexer_k,
                has_q=p.has_indexer_q,
                eps=args.rms_norm_eps,
            )
        for m in (comp, idx):
            if m is not None:
                for prm in m.parameters():
                    torch.nn.init.normal_(prm, std=0.3)
                    if prm.dim() == 1:
                        prm.data.add_(1.0)
        out[p.layer_id] = (plan, comp, idx)
    return out


def _run(args, mods, cache, bt, xs, qrs, chunks_per_seq):
    """Feed sequences chunk by chunk (all sequences in one batch per step); return per-layer selections."""
    steps = max(len(c) for c in chunks_per_seq)
    done = [0] * len(xs)
    seen: dict[int, list[list[torch.Tensor]]] = {}
    views: dict[int, list[torch.Tensor]] = {}
    for s in range(steps):
        seqs = [i for i, c in enumerate(chunks_per_seq) if s < len(c)]
        ids, pos, lens = [], [], []
        xr, qr = [], []
        for i in seqs:
            n = chunks_per_seq[i][s]
            p0 = done[i]
            pos.append(torch.arange(p0, p0 + n))
            ids.append(torch.zeros(n, dtype=torch.int64))
            xr.append(xs[i][p0 : p0 + n])
            qr.append(qrs[i][p0 : p0 + n])
            lens.append(n)
        batch = ForwardBatch(
            input_ids=torch.cat(ids),
            positions=torch.cat(pos),
            query_lens=tuple(lens),
            slots=tuple(seqs),
            block_tables=bt[seqs],
            logits_indices=torch.zeros(1, dtype=torch.int64),
        )
        ctx = ForwardContext.build(batch, cache)
        x, q = torch.cat(xr), torch.cat(qr)
        for lid, (plan, comp, idx) in mods.items():
            if plan.has_compressor:
                csa2_update_source(plan=plan, compressor=comp, indexer=idx, x=x, ctx=ctx, rope=_rope)
            sel = csa2_select(plan=plan, indexer=idx, x=x, qr=q, ctx=ctx, rope=_rope)
            for j, i in enumerate(seqs):
                rows = ctx.seq_rows(j)
                ind = sel.indices[rows]
                # store rows -> the sequence's local entry ids w (the index of the row in its entry list)
                view = ctx.compressed[plan.kv_source]
                own = view.rows[view.seq_offsets[j] : view.seq_offsets[j] + view.seq_counts[j]]
                hit = torch.cat([ind[..., None] == own[None, None, :], torch.ones_like(ind[..., None], dtype=bool)], -1)
                local = torch.where(ind >= 0, hit.int().argmax(-1), torch.full_like(ind, -1))
                seen.setdefault(lid, [[] for _ in xs])[i].append(local)
                # the gathered kv of the selection, for value comparisons
                kv = torch.where((ind >= 0)[..., None], sel.kv[ind.clamp(min=0)], torch.zeros(()))
                views.setdefault(lid, [[] for _ in xs])[i].append(kv)
        for i in seqs:
            done[i] += chunks_per_seq[i][s]
    cat = {lid: [torch.cat(v) for v in per] for lid, per in seen.items()}
    kvs = {lid: [torch.cat(v) for v in per] for lid, per in views.items()}
    return cat, kvs


def _inputs(args, lens, seed=5):
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randn(n, args.hidden_size, generator=g) for n in lens]
    qrs = [
        rms_norm(torch.randn(n, args.q_lora_rank, generator=g), torch.ones(args.q_lora_rank), 1e-20)
        for n in lens
    ]
    return xs, qrs


def test_chunked_equals_full_and_reuse_matches_source(tiny: ModelArgs) -> None:
    mods = _modules(tiny)
    lens = [13, 9]
    xs, qrs = _inputs(tiny, lens)
    cache, bt = ModelCache.allocate_dense(tiny, lens, dtype=torch.float32, page_size=4)
    full, full_kv = _run(tiny, mods, cache, bt, xs, qrs, [[13], [9]])
    cache2, bt2 = ModelCache.allocate_dense(tiny, lens, dtype=torch.float32, page_size=4)
    # odd chunk boundaries exercise the ratio-2 ring; seq 1 decodes token by token
    chunked, chunked_kv = _run(tiny, mods, cache2, bt2, xs, qrs, [[3, 1, 4, 5], [1] * 9])
    for lid in full:
        for i in range(len(lens)):
            assert torch.equal(full[lid][i], chunked[lid][i]), f"layer {lid} seq {i}"
            torch.testing.assert_close(full_kv[lid][i], chunked_kv[lid][i], rtol=0, atol=1e-5)
    # Reuse layers see exactly the indices of their source (3 <- 2, 6 <- 5)
    for reuse, src in ((3, 2), (6, 5)):
        for i in range(len(lens)):
            assert torch.equal(full[reuse][i], full[src][i])
    # ratio 2: query t sees entries w < floor((t+1)/2); ratio 1: its own entry (k=4 >= visible for t < 4)
    sel2 = full[2][0]
    for t in range(lens[0]):
        valid = sel2[t][sel2[t] >= 0]
        assert valid.numel() == min(4, (t + 1) // 2)
        assert bool((valid < (t + 1) // 2).all())
    sel5 = full[5][0]
    for t in range(4):
        assert sel5[t][sel5[t] >= 0].tolist() == list(range(t + 1))


def test_consumer_stays_inside_candidate_blocks(tiny: ModelArgs) -> None:
    mods = _modules(tiny, seed=3)
    lens = [16]
    xs, qrs = _inputs(tiny, lens, seed=9)
    cache, bt = ModelCache.allocate_dense(tiny, lens, dtype=torch.float32, page_size=4)
    batch = ForwardBatch.single(torch.zeros(16, dtype=torch.int64), block_table=bt[0])
    ctx = ForwardContext.build(batch, cache)
    x, q = xs[0], qrs[0]
    for plan, comp, idx in mods.values():
        if plan.has_compressor:
            csa2_update_source(plan=plan, compressor=comp, indexer=idx, x=x, ctx=ctx, rope=_rope)
        csa2_select(plan=plan, indexer=idx, x=x, qr=q, ctx=ctx, rope=_rope)
    blocks = ctx.candidates[5]  # [T, num_blocks]; block size 2, 3 blocks kept
    bs = tiny.candidate_block_size
    assert blocks.shape == (16, 8)
    restricted = 0
    for t in range(16):
        chosen = set(torch.nonzero(blocks[t]).squeeze(-1).tolist())
        assert len(chosen) == min(tiny.candidate_topk_blocks, t // bs + 1)
        assert t // bs in chosen  # newest visible entry (own token, ratio 1) -> pinned block
        for w in ctx.topk[7][t].tolist():
            if w >= 0:
                assert w // bs in chosen
                assert w <= t
        restricted += int(len(chosen) * bs < t + 1)
        # the candidate filter actually changes something for long rows: 6 candidates > top-k 4
        n_valid = int((ctx.topk[7][t] >= 0).sum())
        assert n_valid == min(tiny.index_topk, sum(min(bs, t + 1 - b * bs) for b in chosen))
    assert restricted > 0


def test_compressed_entries_and_index_keys_follow_the_formula(tiny: ModelArgs) -> None:
    """C_w = RoPE(RMSNorm(Σ softmax(Z)·A; norm), 2w) and KI_w = RoPE(RMSNorm(wk · pre-RoPE latent; k_norm), 2w)."""
    mods = _modules(tiny, seed=7)
    n = 7
    xs, qrs = _inputs(tiny, [n], seed=2)
    cache, bt = ModelCache.allocate_dense(tiny, [n], dtype=torch.float32, page_size=4)
    ctx = ForwardContext.build(
        ForwardBatch.single(torch.zeros(n, dtype=torch.int64), block_table=bt[0]), cache
    )
    plan, comp, idx = mods[2]
    view = csa2_update_source(plan=plan, compressor=comp, indexer=idx, x=xs[0], ctx=ctx, rope=_rope)
    assert view.seq_counts == (3,) and view.ratio == 2  # token 6 opened group 3
    eps = tiny.rms_norm_eps
    for w in range(3):
        xa, xb = xs[0][2 * w], xs[0][2 * w + 1]
        a = torch.stack([comp.wkv.weight @ xa, comp.wkv.weight @ xb])
        z = torch.stack([comp.wgate.weight @ xa, comp.wgate.weight @ xb])
        pooled = (torch.softmax(z, 0) * a).sum(0)
        latent = pooled / torch.sqrt(pooled.pow(2).mean() + eps) * comp.norm.weight
        pos = torch.tensor([2 * w])
        torch.testing.assert_close(view.kv[w], _rope(latent[None], pos)[0], rtol=1e-5, atol=1e-5)
        k = idx.wk.weight @ latent
        k = k / torch.sqrt(k.pow(2).mean() + eps) * idx.k_norm.weight
        torch.testing.assert_close(view.index_keys[w], _rope(k[None], pos)[0], rtol=1e-5, atol=1e-5)


def test_full_v41_layout_builds_valid_plans() -> None:
    from deepinfer_engine.model.presets import v41_flash_config

    args = ModelArgs.from_config_dict(v41_flash_config())
    plans = {p.layer_id: Csa2Plan.from_layer_plan(p, args) for p in args.layer_plans if p.kind == "csa2"}
    assert sorted(plans) == list(range(2, 40))
    assert [lid for lid, p in plans.items() if p.has_compressor] == [2, 8, 14, 20]
    assert [lid for lid, p in plans.items() if p.publishes_candidates] == [20]
    consumers = [lid for lid, p in plans.items() if p.consumes_candidates]
    assert consumers == [24, 28, 32, 36]
    assert all(plans[c].kv_source == 20 for c in consumers)
    assert plans[37].index_source == 36 and plans[37].kv_source == 20 and not plans[37].has_indexer_q
