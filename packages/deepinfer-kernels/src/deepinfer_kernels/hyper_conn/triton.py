"""Triton backend of the mHC mix coefficients: `hc_mix` in one launch instead of ~90 small torch kernels.

`_hc_mix_fused_kernel`, grid (token groups, K splits): each program computes partial logits `R_flat @ fn^T`
([tokens, (2+n)n]) and partial sums of squares over one slice of the n*d axis in fp32 (exact fp32 products; fn
is fp32 in the checkpoint) and stores them to a workspace. Splitting the 20,480-long axis lets a decode batch of
1 use every SM instead of one SM reading all of fn (1.97 MB). The program that arrives last at its token group's
arrival counter (an acq_rel atomic) sums the partials in a fixed split order, so results do not depend on arrival
order, then applies the RMS scale, the pre / post / comb split of the (2+n)n coefficients, sigmoids and the whole
Sinkhorn (n x n in registers, `ITERS` unrolled), and resets the counter to 0: a zeroed counter buffer stays zero,
so a caller-owned one needs no fill per call (CUDA-graph capturable). Plans (`_fused_plan`): one token per program
on the CUDA cores up to PRODUCTS_MAX_T tokens, then "bf16x3" tensor-core dots for bf16 streams.

The two-launch path (`fused=False`) is kept for comparison: `_hc_mix_partial_rows_kernel` (T <= ROWS_MAX_T, one
token per program) or `_hc_mix_partial_kernel` (16-token tl.dot tiles), then `_hc_mix_finish_kernel`, one program
per token.

`hc_pre` (collapse) and `hc_post` (combine) are single elementwise passes over [T, n, d] with fp32 math, instead
of the reference's fp32 copies of the streams plus an einsum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable, next_pow2, target_programs

__all__ = ["PRODUCTS_MAX_T", "ROWS_MAX_T", "hc_mix", "hc_post", "hc_post_pre", "hc_pre"]

# Up to this many tokens hc_mix's first stage runs one token per program (decode); larger T tiles 16 tokens into a
# tl.dot. The split count goes up to 128 there: at batch 1 the 2 MB of fn are spread over more programs.
ROWS_MAX_T = 8
# The fused hc_mix's default runs one token per program on the CUDA cores up to this many tokens (measured faster
# than the bf16x3 tensor-core dots at 64 tokens, slower at 256)
PRODUCTS_MAX_T = 128


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


# Finishing a token group in the fused kernel reads the partials of SC splits per step: SC * tokens * BLOCK_M fp32
# stays within this many elements (64 registers a thread at 4 warps; every default plan stays <= 128 registers with
# no spills in the sm_90 build), whatever the split count. The plans cap splits at 2 * SC: the finish is at most two steps of
# dependent L2 round trips.
_FINISH_TILE = 8192


@triton.jit
def _finish_group(
    part_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, offs_t, t_mask, T, num_splits, inv_k,
    rms_eps, hc_eps, M: tl.constexpr, N: tl.constexpr, ITERS: tl.constexpr, TOK: tl.constexpr, SC: tl.constexpr,
):  # fmt: skip
    """The finish of `_hc_mix_finish_kernel` for the TOK tokens offs_t at once: partials summed over the splits SC
    at a time (a fixed order, so the result does not depend on which program arrives last), RMS scale, sigmoids,
    Sinkhorn on [TOK, N, N]. Loads are .cg: other programs' partials are in L2, never in this SM's L1."""
    NN: tl.constexpr = N * N
    offs_c = tl.arange(0, SC)
    offs_n = tl.arange(0, N)
    offs_nn = tl.arange(0, NN)
    sq = tl.zeros([TOK], dtype=tl.float32)
    pre_l = tl.zeros([TOK, N], dtype=tl.float32)
    post_l = tl.zeros([TOK, N], dtype=tl.float32)
    comb_l = tl.zeros([TOK, NN], dtype=tl.float32)
    for s0 in range(0, num_splits, SC):
        offs_s = (s0 + offs_c).to(tl.int64)
        row = offs_s[:, None] * T + offs_t[None, :]  # [SC, TOK] rows of the workspace part [splits, T, M]
        mask = (offs_s < num_splits)[:, None] & t_mask[None, :]
        sq += tl.sum(tl.load(sq_ptr + row, mask=mask, other=0.0, cache_modifier=".cg"), 0)
        p3 = part_ptr + row[:, :, None] * M
        m3 = mask[:, :, None]
        pre_l += tl.sum(tl.load(p3 + offs_n[None, None, :], mask=m3, other=0.0, cache_modifier=".cg"), 0)
        post_l += tl.sum(tl.load(p3 + N + offs_n[None, None, :], mask=m3, other=0.0, cache_modifier=".cg"), 0)
        comb_l += tl.sum(tl.load(p3 + 2 * N + offs_nn[None, None, :], mask=m3, other=0.0, cache_modifier=".cg"), 0)
    rs = (1.0 / tl.sqrt(sq * inv_k + rms_eps))[:, None]
    s_pre = tl.load(scale_ptr + 0)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    pre = _sigmoid(pre_l * rs * s_pre + tl.load(base_ptr + offs_n)[None, :]) + hc_eps
    post = 2.0 * _sigmoid(post_l * rs * s_post + tl.load(base_ptr + N + offs_n)[None, :])
    c0 = tl.reshape(comb_l * rs * s_comb + tl.load(base_ptr + 2 * N + offs_nn)[None, :], [TOK, N, N])
    # Sinkhorn as the reference: row softmax + eps, column normalise, then (ITERS-1) x (rows, columns)
    e = tl.exp(c0 - tl.max(c0, 2)[:, :, None])
    c = e / tl.sum(e, 2)[:, :, None] + hc_eps
    c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)
    for _ in tl.static_range(ITERS - 1):
        c = c / (tl.sum(c, 2)[:, :, None] + hc_eps)
        c = c / (tl.sum(c, 1)[:, None, :] + hc_eps)
    tn = offs_t[:, None] * N + offs_n[None, :]
    tl.store(pre_ptr + tn, pre, mask=t_mask[:, None])
    tl.store(post_ptr + tn, post, mask=t_mask[:, None])
    ij = offs_n[:, None] * N + offs_n[None, :]
    tl.store(comb_ptr + offs_t[:, None, None] * NN + ij[None, :, :], c, mask=t_mask[:, None, None])


@triton.jit(do_not_specialize=["T", "chunks_per_split", "num_splits"])
def _hc_mix_fused_kernel(
    r_ptr, fn_ptr, part_ptr, sq_ptr, cnt_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, KDIM,
    chunks_per_split, num_splits, stride_rt, stride_fn, inv_k, rms_eps, hc_eps, M: tl.constexpr, N: tl.constexpr,
    ITERS: tl.constexpr, MODE: tl.constexpr, SPLIT: tl.constexpr, TOK: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, SC: tl.constexpr, DOT_F32: tl.constexpr,
):  # fmt: skip
    """hc_mix in one launch, grid (token groups of TOK, K splits). Each program computes its slice's partial
    logits and sums of squares for TOK tokens and stores them to the workspace; with SPLIT the program that
    arrives last at its group's counter (acq_rel) finishes the group and resets the counter to 0.
    MODE 0: fp32 products on the CUDA cores (no padding of a small group to 16 rows). MODE 1: one exact-fp32 tl.dot
    ("ieee": FMAs with operands through shared memory), TOK >= 16. MODE 2 (bf16 streams only): tensor-core tl.dots
    of the bf16 streams with fn split into three bf16 terms hi + mid + lo (24 significant bits, all of fp32's), so
    every product is exact in fp32 and only the fp32 accumulation (order, tensor-core rounding) differs from
    MODE 1; TOK >= 16."""
    g = tl.program_id(0)
    s = tl.program_id(1).to(tl.int64)
    offs_t = (g * TOK + tl.arange(0, TOK)).to(tl.int64)
    offs_m = tl.arange(0, BLOCK_M)
    t_mask = offs_t < T
    m_mask = offs_m < M
    acc = tl.zeros([TOK, BLOCK_M], dtype=tl.float32)
    # products mode: each (token, coefficient, k lane) sums in its own register and the k lanes are reduced once
    # after the loop (a reduction per iteration costs ~6 shuffles per multiply in the sm_90 code)
    KP: tl.constexpr = BLOCK_K if MODE == 0 else 1
    acc3 = tl.zeros([TOK, BLOCK_M, KP], dtype=tl.float32)
    sq = tl.zeros([TOK, BLOCK_K], dtype=tl.float32)
    k_lo = s * chunks_per_split * BLOCK_K
    k_hi = tl.minimum(k_lo + chunks_per_split * BLOCK_K, KDIM)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < k_hi
        xs = tl.load(
            r_ptr + offs_t[:, None] * stride_rt + offs_k[None, :], mask=t_mask[:, None] & k_mask[None, :], other=0.0
        )
        x = xs.to(tl.float32)
        w = tl.load(
            fn_ptr + offs_m[:, None] * stride_fn + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0
        ).to(tl.float32)
        if MODE == 0:
            acc3 += w[None, :, :] * x[:, None, :]
        elif MODE == 1:
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            w_hi = w.to(tl.bfloat16)
            rem = w - w_hi.to(tl.float32)  # exact: w_hi is w rounded to 8 significant bits
            w_mid = rem.to(tl.bfloat16)
            w_lo = (rem - w_mid.to(tl.float32)).to(tl.bfloat16)
            if DOT_F32:  # the CPU interpreter's bf16 dots are wrong; the same exact products in fp32
                acc = tl.dot(x, tl.trans(w_lo.to(tl.float32)), acc, input_precision="ieee")  # smallest terms first
                acc = tl.dot(x, tl.trans(w_mid.to(tl.float32)), acc, input_precision="ieee")
                acc = tl.dot(x, tl.trans(w_hi.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(xs, tl.trans(w_lo), acc)  # smallest terms first
                acc = tl.dot(xs, tl.trans(w_mid), acc)
                acc = tl.dot(xs, tl.trans(w_hi), acc)
        sq += x * x
    if MODE == 0:
        acc = tl.sum(acc3, 2)
    row = s * T + offs_t
    tl.store(part_ptr + row[:, None] * M + offs_m[None, :], acc, mask=t_mask[:, None] & m_mask[None, :])
    tl.store(sq_ptr + row, tl.sum(sq, 1), mask=t_mask)
    # every thread's partial is stored before the one release below publishes it (and, unsplit, before the
    # finish reads it back)
    tl.debug_barrier()
    if SPLIT:
        arrived = tl.atomic_add(cnt_ptr + g, 1, sem="acq_rel")
        if arrived == num_splits - 1:
            _finish_group(part_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, offs_t, t_mask, T,
                          num_splits, inv_k, rms_eps, hc_eps, M, N, ITERS, TOK, SC)  # fmt: skip
            tl.atomic_xchg(cnt_ptr + g, 0)
    else:
        _finish_group(part_ptr, sq_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, offs_t, t_mask, T,
                      num_splits, inv_k, rms_eps, hc_eps, M, N, ITERS, TOK, SC)  # fmt: skip


def hc_mix(
    r: Tensor,
    fn: Tensor,
    base: Tensor,
    scale: Tensor,
    *,
    sinkhorn_iters: int,
    hc_eps: float,
    rms_eps: float,
    fused: bool = True,
    counters: Tensor | None = None,
    mode: str | None = None,
    num_splits: int | None = None,
    block_t: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
) -> tuple[Tensor, Tensor, Tensor]:
    """r [T, n, d] any float dtype (n a power of two); fn [(2+n)n, n*d]; base [(2+n)n]; scale [3] ->
    pre [T, n], post [T, n], comb [T, n, n] fp32. Validated by the package dispatcher.

    fused (default): one launch, `_hc_mix_fused_kernel`; else the two-launch path (first stage + finish kernel).
    counters: caller-owned zeroed 1-D int32 on r's device (e.g. `deepinfer_kernels.linear.split_k_counters`), left
    zero by every launch; a split launch of G token groups needs >= G entries, else zeros are allocated per call.
    Tuning knobs (None = the policy of `_fused_plan` / the old path): mode (fused: "products" CUDA-core fp32
    products, "dot" exact-fp32 tl.dot, "bf16x3" tensor-core dots of bf16 streams with fn in three bf16 terms; the
    dots take block_t >= 16 tokens), num_splits (of the n*d axis), block_t (fused: tokens per program, a power of
    two; two-launch: the tl.dot tile), block_k, num_warps."""
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
    interp = check_launchable("hc_mix", _hc_mix_partial_kernel, rf, fn, base, scale)
    eps = (1.0 / kdim, float(rms_eps), float(hc_eps))
    if not fused:
        _two_launch(rf, fn, base, scale, pre, post, comb, n, int(sinkhorn_iters), eps, num_splits,
                    16 if block_t is None else block_t, 128 if block_k is None else block_k, num_warps)  # fmt: skip
        return pre, post, comb
    mode, tok, bk, splits, cps = _fused_plan(t, m, kdim, r.dtype, dev, mode, num_splits, block_t, block_k)
    groups = cdiv(t, tok)
    block_m = _block_m(mode, m)
    part = torch.empty((splits, t, m), dtype=torch.float32, device=dev)
    sq = torch.empty((splits, t), dtype=torch.float32, device=dev)
    if splits > 1 and (counters is None or counters.numel() < groups):
        counters = torch.zeros(groups, dtype=torch.int32, device=dev)
    elif splits == 1:
        counters = sq  # never read: an unsplit launch touches no counter
    _hc_mix_fused_kernel[(groups, splits)](
        rf, fn, part, sq, counters, base, scale, pre, post, comb, t, kdim, cps, splits, rf.stride(0), fn.stride(0),
        *eps, M=m, N=n, ITERS=int(sinkhorn_iters), MODE=_MODES.index(mode), SPLIT=splits > 1, TOK=tok, BLOCK_M=block_m,
        BLOCK_K=bk, SC=_finish_splits(tok, block_m), DOT_F32=interp, num_warps=num_warps,
    )  # fmt: skip
    return pre, post, comb


_MODES = ("products", "dot", "bf16x3")  # the kernel's MODE constexpr is the index


def _block_m(mode: str, m: int) -> int:
    return max(2 if mode == "products" else 16, next_pow2(m))  # a dot operand has >= 16 rows


def _finish_splits(tok: int, block_m: int) -> int:
    return max(1, _FINISH_TILE // (tok * block_m))


def _fused_plan(
    t: int, m: int, kdim: int, dtype: torch.dtype, dev: torch.device, mode: str | None, num_splits: int | None,
    block_t: int | None, block_k: int | None,
) -> tuple[str, int, int, int, int]:
    """(mode, tokens per program, BLOCK_K, splits, chunks per split) of the fused kernel. Default (H200,
    `benchmarks/bench_hc_mix.py`, docs/perf.md "mHC hc_mix in one launch"): CUDA-core products with one token per
    program up to PRODUCTS_MAX_T tokens (a dot would pad each token to 16 rows; at 64 tokens this was 36.6 us
    against 45.8 for bf16x3); past it bf16 streams take "bf16x3" tensor-core dots, 16 tokens a program (256 tokens:
    59.8 us, against 71.0 with 32 a program and 89.2 for products), other dtypes products in groups of 8 (16 past
    512 tokens). Products keep the
    per-lane accumulators at 4K fp32 (32 registers a thread at 4 warps). Splits fill the GPU about twice, at most
    128 for one token per program, else 64, and at most two finish steps (2 * `_finish_splits`)."""
    if mode is None:
        mode = "products" if t <= PRODUCTS_MAX_T or dtype != torch.bfloat16 else "bf16x3"
    if mode not in _MODES:
        raise ValueError(f"hc_mix: mode {mode!r}, expected one of {_MODES}")
    if mode == "bf16x3" and dtype != torch.bfloat16:
        raise ValueError(f"hc_mix: mode 'bf16x3' needs bf16 streams (exact in bf16), found {dtype}; use 'dot'")
    if block_t is None:
        if mode == "products":
            block_t = 1 if t <= PRODUCTS_MAX_T else 8 if t <= 512 else 16
        else:
            block_t = 16
    tok = next_pow2(max(1, int(block_t)))
    if mode != "products":
        tok = max(16, tok)  # the tl.dot minimum
    if block_k is None:
        block_k = {"dot": 32, "bf16x3": 64}.get(mode) or max(16, min(128, 4096 // (tok * max(16, next_pow2(m)))))
    bk = max(16, next_pow2(int(block_k)))
    groups = cdiv(t, tok)
    chunks = cdiv(kdim, bk)
    if num_splits is None:
        cap = min(128 if tok == 1 else 64, 2 * _finish_splits(tok, _block_m(mode, m)))
        num_splits = min(chunks, max(1, cdiv(target_programs(dev), groups)), cap)
    num_splits = max(1, min(int(num_splits), chunks))
    cps = cdiv(chunks, num_splits)
    return mode, tok, bk, cdiv(chunks, cps), cps


def _two_launch(
    rf: Tensor, fn: Tensor, base: Tensor, scale: Tensor, pre: Tensor, post: Tensor, comb: Tensor, n: int, iters: int,
    eps: tuple[float, float, float], num_splits: int | None, block_t: int, block_k: int, num_warps: int,
) -> None:
    """The two-launch hc_mix (first stage, then `_hc_mix_finish_kernel`), kept for comparison with the fused one."""
    t, kdim = rf.shape
    m = (2 + n) * n
    dev = rf.device
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
            rf, fn, part, sq, t, kdim, chunks_per_split, rf.stride(0), fn.stride(0),
            M=m, BLOCK_T=block_t, BLOCK_M=max(16, next_pow2(m)), BLOCK_K=block_k, num_warps=num_warps,
        )  # fmt: skip
    _hc_mix_finish_kernel[(t,)](
        part, sq, base, scale, pre, post, comb, t, num_splits, *eps,
        N=n, ITERS=iters, BLOCK_S=max(2, next_pow2(num_splits)), num_warps=1,
    )  # fmt: skip


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
