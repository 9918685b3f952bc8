"""Triton backend of the mHC mix coefficients: `hc_mix` in two launches instead of ~90 small torch kernels.

1. `_hc_mix_partial_kernel`, grid (token blocks, K splits): partial logits `R_flat @ fn^T` ([BLOCK_T, (2+n)n])
   and partial sums of squares over one slice of the n*d axis, fp32 (exact fp32 dots; fn is fp32 in the
   checkpoint). Splitting the 20,480-long axis lets a decode batch of 1 use every SM instead of one SM reading
   all of fn (1.97 MB). Decode batches (T <= ROWS_MAX_T) use `_hc_mix_partial_rows_kernel` instead, grid (tokens,
   K splits): one token per program, products summed without a dot (a dot pads the token to 16 rows).
2. `_hc_mix_finish_kernel`, one program per token: sum the partials, RMS scale, the pre / post / comb split of
   the (2+n)n coefficients, sigmoids and the whole Sinkhorn (n x n in registers, `ITERS` unrolled).

`hc_pre` (collapse) and `hc_post` (combine) are single elementwise passes over [T, n, d] with fp32 math, instead
of the reference's fp32 copies of the streams plus an einsum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable, next_pow2, target_programs

__all__ = ["ROWS_MAX_T", "hc_mix", "hc_post", "hc_post_pre", "hc_pre"]

# Up to this many tokens hc_mix's first stage runs one token per program (decode); larger T tiles 16 tokens into a
# tl.dot. The split count goes up to 128 there: at batch 1 the 2 MB of fn are spread over more programs.
ROWS_MAX_T = 8


@triton.jit(do_not_specialize=["T", "chunks_per_split"])  # one compile for every batch size
def _hc_mix_partial_kernel(
    r_ptr,
    fn_ptr,
    part_ptr,
    sq_ptr,
    T,
    KDIM,
    chunks_per_split,
    stride_rt,
    stride_fn,
    M: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    tb = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    offs_t = (tb * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    t_mask = offs_t < T
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_T, BLOCK_M], dtype=tl.float32)
    sq = tl.zeros([BLOCK_T], dtype=tl.float32)
    k_lo = s * chunks_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + chunks_per_split * BLOCK_K, KDIM)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(
            r_ptr + offs_t[:, None] * stride_rt + offs_k[None, :],
            mask=t_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        w = tl.load(
            fn_ptr + offs_m[:, None] * stride_fn + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        sq += tl.sum(x * x, 1)
    row = s * T + offs_t  # workspace part [splits, T, M], sq [splits, T]
    tl.store(part_ptr + row[:, None] * M + offs_m[None, :], acc, mask=t_mask[:, None] & m_mask[None, :])
    tl.store(sq_ptr + row, sq, mask=t_mask)


@triton.jit(do_not_specialize=["T", "chunks_per_split"])
def _hc_mix_partial_rows_kernel(
    r_ptr,
    fn_ptr,
    part_ptr,
    sq_ptr,
    T,
    KDIM,
    chunks_per_split,
    stride_rt,
    stride_fn,
    M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # one token per program: exact fp32 products summed on the CUDA cores (a tl.dot would pad the token to 16 rows)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    acc = tl.zeros([BLOCK_M], dtype=tl.float32)
    sq = tl.zeros([BLOCK_K], dtype=tl.float32)
    k_lo = s * chunks_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + chunks_per_split * BLOCK_K, KDIM)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        x = tl.load(r_ptr + t * stride_rt + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(
            fn_ptr + offs_m[:, None] * stride_fn + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(w * x[None, :], 1)
        sq += x * x
    row = s * T + t  # same workspace as _hc_mix_partial_kernel: part [splits, T, M], sq [splits, T]
    tl.store(part_ptr + row * M + offs_m, acc, mask=m_mask)
    tl.store(sq_ptr + row, tl.sum(sq, 0))


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit(do_not_specialize=["T", "num_splits"])
def _hc_mix_finish_kernel(
    part_ptr,
    sq_ptr,
    base_ptr,
    scale_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    T,
    num_splits,
    inv_k,
    rms_eps,
    hc_eps,
    N: tl.constexpr,
    ITERS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    offs_n = tl.arange(0, N)
    s_mask = offs_s < num_splits
    row = (offs_s * T + t) * ((2 + N) * N)  # [BLOCK_S] start of each split's coefficients for token t

    sq = tl.sum(tl.load(sq_ptr + offs_s * T + t, mask=s_mask, other=0.0), 0)
    rs = 1.0 / tl.sqrt(sq * inv_k + rms_eps)
    s_pre = tl.load(scale_ptr + 0)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)

    pre_l = tl.sum(tl.load(part_ptr + row[:, None] + offs_n[None, :], mask=s_mask[:, None], other=0.0), 0)
    pre = _sigmoid(pre_l * rs * s_pre + tl.load(base_ptr + offs_n)) + hc_eps
    post_l = tl.sum(
        tl.load(part_ptr + row[:, None] + N + offs_n[None, :], mask=s_mask[:, None], other=0.0), 0
    )
    post = 2.0 * _sigmoid(post_l * rs * s_post + tl.load(base_ptr + N + offs_n))

    ij = offs_n[:, None] * N + offs_n[None, :]  # comb[i, j] = coefficient 2N + i*N + j (row-major view)
    comb_l = tl.sum(
        tl.load(
            part_ptr + row[:, None, None] + 2 * N + ij[None, :, :], mask=s_mask[:, None, None], other=0.0
        ),
        0,
    )
    c0 = comb_l * rs * s_comb + tl.load(base_ptr + 2 * N + ij)
    # Sinkhorn exactly as the reference: row softmax + eps, column normalise, then (ITERS-1) x (rows, columns).
    e = tl.exp(c0 - tl.max(c0, 1)[:, None])
    c = e / tl.sum(e, 1)[:, None] + hc_eps
    c = c / (tl.sum(c, 0)[None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        c = c / (tl.sum(c, 1)[:, None] + hc_eps)
        c = c / (tl.sum(c, 0)[None, :] + hc_eps)

    tl.store(pre_ptr + t * N + offs_n, pre)
    tl.store(post_ptr + t * N + offs_n, post)
    tl.store(comb_ptr + t * N * N + ij, c)


def hc_mix(
    r: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    rms_eps: float,
    num_splits: int | None = None,
    block_t: int = 16,
    block_k: int = 128,
    num_warps: int = 4,
) -> tuple[Tensor, Tensor, Tensor]:
    """r [T, n, d] any float dtype (n a power of two); fn [(2+n)n, n*d]; base [(2+n)n]; scale [3] ->
    pre [T, n], post [T, n], comb [T, n, n] fp32. Validated by the package dispatcher."""
    t, n, d = r.shape
    m = (2 + n) * n
    kdim = n * d
    dev = r.device
    pre = torch.empty((t, n), dtype=torch.float32, device=dev)
    post = torch.empty((t, n), dtype=torch.float32, device=dev)
    comb = torch.empty((t, n, n), dtype=torch.float32, device=dev)
    if t == 0:
        return pre, post, comb
    rf = r.reshape(t, kdim)
    if rf.stride(1) != 1:
        rf = rf.contiguous()
    fn = fn.float()
    if fn.stride(1) != 1:
        fn = fn.contiguous()
    base = base.float().contiguous()
    scale = scale.float().contiguous()
    check_launchable("hc_mix", _hc_mix_partial_kernel, rf, fn, base, scale)
    rows = t <= ROWS_MAX_T  # decode batches: one token per program, no padded dot
    t_blocks = t if rows else cdiv(t, block_t)
    chunks = cdiv(kdim, block_k)
    if num_splits is None:
        num_splits = min(chunks, max(1, cdiv(target_programs(dev), t_blocks)), 128 if rows else 64)
    num_splits = max(1, min(int(num_splits), chunks))
    chunks_per_split = cdiv(chunks, num_splits)
    num_splits = cdiv(chunks, chunks_per_split)
    part = torch.empty((num_splits, t, m), dtype=torch.float32, device=dev)
    sq = torch.empty((num_splits, t), dtype=torch.float32, device=dev)
    if rows:
        _hc_mix_partial_rows_kernel[(t, num_splits)](
            rf, fn, part, sq, t, kdim, chunks_per_split, rf.stride(0), fn.stride(0),
            M=m, BLOCK_M=max(2, next_pow2(m)), BLOCK_K=block_k, num_warps=num_warps,
        )  # fmt: skip
    else:
        _hc_mix_partial_kernel[(t_blocks, num_splits)](
            rf,
            fn,
            part,
            sq,
            t,
            kdim,
            chunks_per_split,
            rf.stride(0),
            fn.stride(0),
            M=m,
            BLOCK_T=block_t,
            BLOCK_M=max(16, next_pow2(m)),
            BLOCK_K=block_k,
            num_warps=num_warps,
        )
    _hc_mix_finish_kernel[(t,)](
        part,
        sq,
        base,
        scale,
        pre,
        post,
        comb,
        t,
        num_splits,
        1.0 / kdim,
        float(rms_eps),
        float(hc_eps),
        N=n,
        ITERS=int(sinkhorn_iters),
        BLOCK_S=max(2, next_pow2(num_splits)),
        num_warps=1,
    )
    return pre, post, comb


@triton.jit
def _hc_pre_kernel(r_ptr, pre_ptr, x_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, N)
    d_mask = offs_d < D
    r = tl.load(r_ptr + (t * N + offs_n[:, None]) * D + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    pre = tl.load(pre_ptr + t * N + offs_n).to(tl.float32)
    x = tl.sum(r.to(tl.float32) * pre[:, None], 0)
    tl.store(x_ptr + t * D + offs_d, x.to(x_ptr.dtype.element_ty), mask=d_mask)


@triton.jit
def _hc_post_kernel(y_ptr, r_ptr, post_ptr, comb_ptr, out_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, N)
    d_mask = offs_d < D
    r = tl.load(r_ptr + (t * N + offs_n[:, None]) * D + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    y = tl.load(y_ptr + t * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + offs_n).to(tl.float32)
    comb = tl.load(comb_ptr + t * N * N + offs_n[:, None] * N + offs_n[None, :]).to(tl.float32)  # [i, j]
    # R'_j = post_j * y + sum_i comb[i, j] * R_i (contract over the first index, as the reference)
    mixed = tl.sum(comb[:, :, None] * r.to(tl.float32)[:, None, :], 0)  # [j, BLOCK_D]
    out = post[:, None] * y[None, :] + mixed
    tl.store(
        out_ptr + (t * N + offs_n[:, None]) * D + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask[None, :],
    )


@triton.jit
def _hc_post_pre_kernel(
    y_ptr, r_ptr, post_ptr, comb_ptr, pre_ptr, out_ptr, x_ptr, D, N: tl.constexpr, BLOCK_D: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, N)
    d_mask = offs_d < D
    r = tl.load(r_ptr + (t * N + offs_n[:, None]) * D + offs_d[None, :], mask=d_mask[None, :], other=0.0)
    y = tl.load(y_ptr + t * D + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + offs_n).to(tl.float32)
    comb = tl.load(comb_ptr + t * N * N + offs_n[:, None] * N + offs_n[None, :]).to(tl.float32)  # [i, j]
    mixed = tl.sum(comb[:, :, None] * r.to(tl.float32)[:, None, :], 0)  # [j, BLOCK_D]
    out = (post[:, None] * y[None, :] + mixed).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + (t * N + offs_n[:, None]) * D + offs_d[None, :], out, mask=d_mask[None, :])
    # the collapse reads the streams as stored (rounded to their dtype), as hc_pre over the written R' would
    pre = tl.load(pre_ptr + t * N + offs_n).to(tl.float32)
    x = tl.sum(out.to(tl.float32) * pre[:, None], 0)
    tl.store(x_ptr + t * D + offs_d, x.to(x_ptr.dtype.element_ty), mask=d_mask)


def _streams(r: Tensor) -> Tensor:
    return r if r.is_contiguous() else r.contiguous()


def hc_pre(r: Tensor, pre: Tensor, *, block_d: int = 1024, num_warps: int = 4) -> Tensor:
    """r [T, n, d] (n a power of two), pre [T, n] -> x [T, d] in r's dtype (fp32 math)."""
    t, n, d = r.shape
    x = torch.empty((t, d), dtype=r.dtype, device=r.device)
    if t == 0 or d == 0:
        return x
    r = _streams(r)
    pre = pre.float().contiguous()
    check_launchable("hc_pre", _hc_pre_kernel, r, pre)
    block_d = min(block_d, max(16, next_pow2(d)))
    _hc_pre_kernel[(t, cdiv(d, block_d))](r, pre, x, d, N=n, BLOCK_D=block_d, num_warps=num_warps)
    return x


def hc_post(
    y: Tensor, r: Tensor, post: Tensor, comb: Tensor, *, block_d: int = 1024, num_warps: int = 4
) -> Tensor:
    """y [T, d], r [T, n, d], post [T, n], comb [T, n, n] -> R' [T, n, d] in r's dtype (fp32 math)."""
    t, n, d = r.shape
    out = torch.empty((t, n, d), dtype=r.dtype, device=r.device)
    if t == 0 or d == 0:
        return out
    r = _streams(r)
    y = y.contiguous()
    post = post.float().contiguous()
    comb = comb.float().contiguous()
    check_launchable("hc_post", _hc_post_kernel, y, r, post, comb)
    block_d = min(block_d, max(16, next_pow2(d)))
    _hc_post_kernel[(t, cdiv(d, block_d))](
        y, r, post, comb, out, d, N=n, BLOCK_D=block_d, num_warps=num_warps
    )
    return out


def hc_post_pre(
    y: Tensor, r: Tensor, post: Tensor, comb: Tensor, pre: Tensor, *, block_d: int = 1024, num_warps: int = 4
) -> tuple[Tensor, Tensor]:
    """hc_post then hc_pre of its result in one pass over the streams: y [T, d], r [T, n, d], post / pre [T, n],
    comb [T, n, n] -> (R' [T, n, d], x [T, d]), both in r's dtype."""
    t, n, d = r.shape
    out = torch.empty((t, n, d), dtype=r.dtype, device=r.device)
    x = torch.empty((t, d), dtype=r.dtype, device=r.device)
    if t == 0 or d == 0:
        return out, x
    r = _streams(r)
    y = y.contiguous()
    post, comb, pre = post.float().contiguous(), comb.float().contiguous(), pre.float().contiguous()
    check_launchable("hc_post_pre", _hc_post_pre_kernel, y, r, post, comb, pre)
    block_d = min(block_d, max(16, next_pow2(d)))
    _hc_post_pre_kernel[(t, cdiv(d, block_d))](
        y, r, post, comb, pre, out, x, d, N=n, BLOCK_D=block_d, num_warps=num_warps
    )
    return out, x
