"""Triton Engram kernels. ring_step: one launch reads every token's predecessors, a second writes the step's ids
(the reference's ~15 small ops). hash_rows: one program per token gathers the compressed ids of the token and its
predecessors, applies the DEAD rule and writes every layer's n-gram row ids (~25 torch integer ops in one launch).
engram_inject: one program per token computes the n stream gates (dot, both sums of squares,
sigmoid of the signed square root) and writes ``R_i + gate_i · val`` -- the ~27 torch ops of the reference in
one launch. Two passes over d: the sums, then the update. lookup_rows: one program per looked-up row decodes
its e4m3 codes and UE8M0 scales with integer bit operations (exact, no fp8 hardware path needed) and stores the
rows in the caller's dtype (the reference's gathers, fp8 decode, scale expansion, multiply and cast)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import check_launchable, next_pow2

__all__ = ["engram_inject", "hash_rows", "lookup_rows", "ring_step"]


@triton.jit
def _engram_kernel(
    r_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, m_ptr, o_ptr,
    D, s_rt, s_rn, s_kt, s_kn, s_vt, s_ot, s_on, eps, sqrt_d, clamp,
    HAS_MASK: tl.constexpr, N: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, N)
    dot = tl.zeros([N], dtype=tl.float32)
    sr = tl.zeros([N], dtype=tl.float32)
    sk = tl.zeros([N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        m2 = (n < N)[:, None] & (offs < D)[None, :]
        r = tl.load(r_ptr + t * s_rt + n[:, None] * s_rn + offs[None, :], mask=m2, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t * s_kt + n[:, None] * s_kn + offs[None, :], mask=m2, other=0.0).to(tl.float32)
        qw = tl.load(qw_ptr + n[:, None] * D + offs[None, :], mask=m2, other=0.0).to(tl.float32)
        kw = tl.load(kw_ptr + n[:, None] * D + offs[None, :], mask=m2, other=0.0).to(tl.float32)
        dot += tl.sum(r * qw * kw * k, 1)
        sr += tl.sum(r * r, 1)
        sk += tl.sum(k * k, 1)
    g = dot * (1.0 / tl.sqrt(sr / D + eps)) * (1.0 / tl.sqrt(sk / D + eps)) / sqrt_d
    s = tl.sqrt(tl.maximum(tl.abs(g), clamp))
    s = tl.where(g.to(tl.int32, bitcast=True) < 0, -s, s)  # copysign: -0.0 keeps its sign
    gate = 1.0 / (1.0 + tl.exp(-s))
    if HAS_MASK:
        gate = tl.where(tl.load(m_ptr + t) != 0, 0.0, gate)
    for d0 in range(0, D, BLOCK_D):
        offs = d0 + tl.arange(0, BLOCK_D)
        m2 = (n < N)[:, None] & (offs < D)[None, :]
        r = tl.load(r_ptr + t * s_rt + n[:, None] * s_rn + offs[None, :], mask=m2, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t * s_vt + offs, mask=offs < D, other=0.0).to(tl.float32)
        out = r + gate[:, None] * v[None, :]
        tl.store(o_ptr + t * s_ot + n[:, None] * s_on + offs[None, :], out.to(o_ptr.dtype.element_ty), mask=m2)


def engram_inject(
    r: Tensor, keys: Tensor, val: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
    image_mask: Tensor | None = None,
) -> Tensor:
    """r [T, n, d] (n a power of two), keys [T, n, d], val [T, d] (last dims contiguous), q/k_weight [n, d],
    image_mask [T] bool or None -> [T, n, d] in r's dtype (reference.engram_inject)."""
    from deepinfer_kernels.engram.reference import GATE_CLAMP

    t, n, d = r.shape
    out = torch.empty((t, n, d), dtype=r.dtype, device=r.device)
    if t == 0:
        return out
    r, keys, val = (x if x.stride(-1) == 1 else x.contiguous() for x in (r, keys, val))
    qw, kw = q_weight.contiguous(), k_weight.contiguous()
    if image_mask is None:
        mask = r
    else:  # a bool mask is read as its bytes (a view, no conversion launch)
        mask = image_mask.contiguous()
        mask = mask.view(torch.uint8) if mask.dtype == torch.bool else mask.to(torch.uint8)
    check_launchable("engram_inject", _engram_kernel, r, keys, val, qw, kw)
    block_d = min(1024, next_pow2(d))
    _engram_kernel[(t,)](
        r, keys, val, qw, kw, mask, out, d, r.stride(0), r.stride(1), keys.stride(0), keys.stride(1),
        val.stride(0), out.stride(0), out.stride(1), float(eps), float(d) ** 0.5, GATE_CLAMP,
        HAS_MASK=image_mask is not None, N=n, BLOCK_D=block_d, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _hash_rows_kernel(
    ids_ptr, prev_ptr, cid_ptr, mult_ptr, prime_ptr, off_ptr, out_ptr, n_cid, pad_cid, L, H,
    K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)  # shift s = 0 (the token) .. K (its K-th predecessor); BLOCK_S > K
    prev = tl.load(prev_ptr + t * K + (s - 1), mask=(s >= 1) & (s <= K), other=-1)
    ids = tl.where(s == 0, tl.load(ids_ptr + t), prev)
    cid = tl.load(cid_ptr + tl.minimum(tl.maximum(ids + 1, 0), n_cid - 1))
    neg = (cid < 0).to(tl.int32)
    blocked = tl.max(tl.where(s[None, :] <= s[:, None], neg[None, :], 0), 1) > 0  # a DEAD at s' <= s
    val = tl.where(blocked, pad_cid, cid).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    offs_h = tl.arange(0, BLOCK_H)
    lh = (offs_l < L)[:, None] & (offs_h < H)[None, :]
    mult = tl.load(mult_ptr + offs_l[:, None] * (K + 1) + s[None, :], mask=(offs_l < L)[:, None] & (s <= K)[None, :],
                   other=0)  # fmt: skip
    terms = val[None, :] * mult  # [L, S]
    acc = tl.sum(tl.where(s[None, :] == 0, terms, 0), 1)  # [L]
    for k in tl.static_range(1, K + 1):
        acc = acc ^ tl.sum(tl.where(s[None, :] == k, terms, 0), 1)
        blk = (offs_l[:, None] * K + (k - 1)) * H + offs_h[None, :]
        prime = tl.load(prime_ptr + blk, mask=lh, other=1)
        off = tl.load(off_ptr + blk, mask=lh, other=0)
        tl.store(out_ptr + t * L * K * H + blk, acc[:, None] % prime + off, mask=lh)


def hash_rows(
    token_ids: Tensor, prev: Tensor, cid_table: Tensor, multipliers: Tensor, primes: Tensor, offsets: Tensor,
    pad_cid: int,
) -> Tensor:
    """reference.hash_rows in one program per token (int64 tensors, shapes as there)."""
    t, k = prev.shape
    n_layers, heads = primes.shape[0], primes.shape[2]
    out = torch.empty((t, n_layers, k * heads), dtype=torch.int64, device=token_ids.device)
    if t == 0:
        return out
    args = [a.contiguous() for a in (token_ids, prev, cid_table, multipliers, primes, offsets)]
    check_launchable("engram_hash_rows", _hash_rows_kernel, *args)
    _hash_rows_kernel[(t,)](
        *args, out, cid_table.shape[0], int(pad_cid), n_layers, heads, K=k, BLOCK_S=next_pow2(k + 2),
        BLOCK_L=max(2, next_pow2(n_layers)), BLOCK_H=max(2, next_pow2(heads)), num_warps=1,
    )  # fmt: skip
    return out


@triton.jit
def _ring_read_kernel(
    ring_ptr, ids_ptr, pos_ptr, seq_ptr, ctx_ptr, slot_ptr, prev_ptr, R, BACK: tl.constexpr, BLOCK_B: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    s = 1 + tl.arange(0, BLOCK_B).to(tl.int64)  # shifts 1 .. BACK
    sm = s <= BACK
    p = tl.load(pos_ptr + t)
    sq = tl.load(seq_ptr + t)
    local = p - tl.load(ctx_ptr + sq)
    base = tl.load(slot_ptr + sq) * R
    q = p - s
    in_step = tl.load(ids_ptr + tl.maximum(t - s, 0), mask=sm, other=-1)
    cell = base + ((q % R) + R) % R  # floor remainder (q may be negative)
    in_ring = tl.load(ring_ptr + cell, mask=sm & (q >= 0), other=-1)
    prev = tl.where(local >= s, in_step, in_ring)
    tl.store(prev_ptr + t * BACK + (s - 1), prev, mask=sm)


@triton.jit
def _ring_write_kernel(ring_ptr, ids_ptr, pos_ptr, seq_ptr, ctx_ptr, qlen_ptr, slot_ptr, R, dump_slot):
    t = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + t)
    sq = tl.load(seq_ptr + t)
    keep = p - tl.load(ctx_ptr + sq) >= tl.load(qlen_ptr + sq) - R
    dst = tl.where(keep, tl.load(slot_ptr + sq) * R, dump_slot * R) + p % R
    tl.store(ring_ptr + dst, tl.load(ids_ptr + t))


def ring_step(
    ring: Tensor, token_ids: Tensor, positions: Tensor, seq_of_token: Tensor, seq_ctx: Tensor, seq_qlen: Tensor,
    seq_slot: Tensor, back: int, dump_slot: int,
) -> Tensor:
    """reference.ring_step in two launches: every predecessor read, then every write (the reads see the ring
    before the step, as the reference's order). The ring must be contiguous (it is updated in place)."""
    t = token_ids.shape[0]
    prev = torch.empty((t, back), dtype=torch.int64, device=token_ids.device)
    if t == 0:
        return prev
    seqs = [a.contiguous() for a in (token_ids, positions, seq_of_token, seq_ctx, seq_qlen, seq_slot)]
    ids, pos, seq, ctx, qlen, slot = seqs
    check_launchable("engram_ring_step", _ring_read_kernel, ring, *seqs)
    R = ring.shape[1]
    if back:
        _ring_read_kernel[(t,)](ring, ids, pos, seq, ctx, slot, prev, R, BACK=back,
                                BLOCK_B=max(2, next_pow2(back)), num_warps=1)  # fmt: skip
    _ring_write_kernel[(t,)](ring, ids, pos, seq, ctx, qlen, slot, R, int(dump_slot), num_warps=1)
    return prev


@triton.jit
def _lookup_rows_kernel(w_ptr, s_ptr, ids_ptr, out_ptr, D, SG, GROUP: tl.constexpr, BLOCK_D: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(ids_ptr + i)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < D
    x = tl.load(w_ptr + row * D + cols, mask=ok, other=0).to(tl.int32)  # e4m3 codes s eeee mmm, bias 7
    e = (x >> 3) & 15
    m = x & 7
    normal = (((x & 0x80) << 24) | ((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    sub = tl.where(x >= 0x80, -1.0, 1.0) * m.to(tl.float32) * 0.001953125  # e = 0: m * 2^-9
    v = tl.where(e == 0, sub, normal)
    v = tl.where((x & 0x7F) == 0x7F, float("nan"), v)
    b = tl.load(s_ptr + row * SG + cols // GROUP, mask=ok, other=127).to(tl.int32)  # UE8M0: 2^(b - 127)
    sc = tl.where(b == 0, 0x00400000, b << 23).to(tl.float32, bitcast=True)
    sc = tl.where(b == 255, float("nan"), sc)
    tl.store(out_ptr + i * D + cols, (v * sc).to(out_ptr.dtype.element_ty), mask=ok)


def lookup_rows(weight: Tensor, scale: Tensor, row_ids: Tensor, group: int, out_dtype: torch.dtype) -> Tensor:
    """weight [N, D] e4m3, scale [N, ceil(D / group)] e8m0, row_ids [...] int64 -> [..., D] out_dtype
    (reference.lookup_rows). Validated by the dispatcher."""
    n, d = weight.shape
    flat = row_ids.reshape(-1).contiguous()
    out = torch.empty((*row_ids.shape, d), dtype=out_dtype, device=weight.device)
    if flat.numel() == 0:
        return out
    w, s = weight.contiguous().view(torch.uint8), scale.contiguous().view(torch.uint8)
    check_launchable("lookup_rows", _lookup_rows_kernel, w, s, flat)
    _lookup_rows_kernel[(flat.numel(),)](w, s, flat, out, d, s.shape[1], GROUP=group, BLOCK_D=next_pow2(d),
                                         num_warps=2)  # fmt: skip
    return out
