"""Triton sampling kernels over a large vocabulary.

Greedy argmax in two stages: per (row, chunk) the max, the lowest index reaching it and whether the chunk holds a
NaN; then one program per row combines its chunks. torch's argmax of one row is a single-block reduction (one SM for
129,280 entries at batch 1); the chunks spread a row over many programs.

Inverse-CDF draws without a row-wide cumulative sum. torch's draw (softmax, cumsum, searchsorted) writes the
distribution and its CDF, each a pass over [N, V] in fp32; its scan over 129,280 entries ran at about an eighth of
the H200's copy rate in a speculative round. Here a row is cut into chunks: per (row, chunk) program the chunk's
max, first argmax and sum of exp (or, for plain weights, its sum); then one program per row combines its chunks,
picks the chunk where u * total falls and scans that chunk alone. The distribution, when the caller wants it, is
written by a third pass (in place over the logits if asked).

Draws equal `reference.inverse_cdf_sample` / `reference.softmax_sample` up to float summation order: a token can
differ only where u * total lies within rounding of a CDF step (the tests bound it), never on a zero-weight id.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from deepinfer_kernels._launch import cdiv, check_launchable, next_pow2

__all__ = ["CHUNK", "greedy_argmax", "inverse_cdf_sample", "logsumexp_rows", "residual_sample", "softmax_sample"]

CHUNK = 4096  # entries of a row per first-stage program (32 programs per row of the 129,280-entry vocabulary)
_BIG = tl.constexpr(2**31 - 1)  # an index past every row (V < 2**31); constexpr: a kernel may only read those globals


@triton.jit(do_not_specialize=["V", "C"])
def _chunk_max_kernel(x_ptr, val_ptr, idx_ptr, nan_ptr, V, C, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    is_nan = x != x
    first_nan = tl.min(tl.where(is_nan & ok, offs, _BIG), 0)
    xm = tl.where(is_nan, float("-inf"), x)
    m = tl.max(xm, 0)
    first_max = tl.min(tl.where((xm == m) & ok, offs, _BIG), 0)
    has_nan = first_nan < _BIG
    tl.store(val_ptr + row * C + c, m)
    tl.store(idx_ptr + row * C + c, tl.where(has_nan, first_nan, first_max))
    tl.store(nan_ptr + row * C + c, has_nan.to(tl.int32))


@triton.jit(do_not_specialize=["C"])
def _combine_kernel(val_ptr, idx_ptr, nan_ptr, out_ptr, C, invalid, USE_INVALID: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < C
    v = tl.load(val_ptr + row * C + offs, mask=ok, other=float("-inf"))
    i = tl.load(idx_ptr + row * C + offs, mask=ok, other=_BIG)
    nan = tl.load(nan_ptr + row * C + offs, mask=ok, other=0) != 0
    # a NaN chunk holds its first NaN's index and chunks are in index order: the smallest one is the first NaN
    first_nan = tl.min(tl.where(nan, i, _BIG), 0)
    m = tl.max(v, 0)
    first_max = tl.min(tl.where(ok & (v == m), i, _BIG), 0)
    out = tl.where(first_nan < _BIG, first_nan, first_max).to(tl.int64)
    if USE_INVALID:
        finite = (first_nan == _BIG) & (m != float("inf")) & (m != float("-inf"))
        out = tl.where(finite, out, invalid)
    tl.store(out_ptr + row, out)


def greedy_argmax(logits: Tensor, *, invalid: int | None = None) -> Tensor:
    """logits [N, V] bf16|fp16|fp32 (last dim contiguous) -> [N] int64, exactly reference.greedy_argmax."""
    n, v = logits.shape
    out = torch.empty((n,), dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    check_launchable("greedy_argmax", _chunk_max_kernel, x)
    block = min(CHUNK, next_pow2(v))
    c = cdiv(v, block)
    vals = torch.empty((n, c), dtype=torch.float32, device=x.device)
    idx = torch.empty((n, c), dtype=torch.int32, device=x.device)
    nan = torch.empty((n, c), dtype=torch.int32, device=x.device)
    _chunk_max_kernel[(n, c)](x, vals, idx, nan, v, c, x.stride(0), BLOCK=block, num_warps=8 if block >= 2048 else 4)
    _combine_kernel[(n,)](
        vals, idx, nan, out, c, 0 if invalid is None else int(invalid), USE_INVALID=invalid is not None,
        BLOCK_C=next_pow2(c), num_warps=1,
    )  # fmt: skip
    return out


@triton.jit
def _pick_in_chunk(w, offs, ok, x, below, V):
    """First id of the chunk whose cumulative weight (from `below`) exceeds x, skipping zero weights; when rounding
    leaves none, the chunk's last positive-weight id, else V - 1."""
    cum = tl.cumsum(w, 0) + below
    pos = (w > 0) & ok
    hit = tl.min(tl.where((cum > x) & pos, offs, _BIG), 0)
    last = tl.max(tl.where(pos, offs, -1), 0)
    return tl.where(hit < _BIG, hit, tl.where(last >= 0, last, V - 1))


@triton.jit
def _chunk_choice(sums, co, okc, x, C):
    """(chunk, weight of the chunks before it) where x falls, from per-chunk weights `sums` at chunk ids `co`
    (clamped to C - 1)."""
    incl = tl.cumsum(sums, 0)
    chosen = tl.minimum(tl.sum(((incl <= x) & okc).to(tl.int32), 0), C - 1)
    return chosen, tl.sum(tl.where(co < chosen, sums, 0.0), 0)


@triton.jit(do_not_specialize=["V", "C"])
def _weight_sums_kernel(w_ptr, sum_ptr, V, C, stride_w, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(w_ptr + row * stride_w + offs, mask=offs < V, other=0.0).to(tl.float32)
    tl.store(sum_ptr + row * C + c, tl.sum(w, 0))


@triton.jit(do_not_specialize=["V", "C"])
def _weight_pick_kernel(w_ptr, u_ptr, sum_ptr, out_ptr, V, C, stride_w, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    co = tl.arange(0, BLOCK_C)
    okc = co < C
    sums = tl.load(sum_ptr + row * C + co, mask=okc, other=0.0)
    x = tl.load(u_ptr + row) * tl.sum(sums, 0)
    chunk, below = _chunk_choice(sums, co, okc, x, C)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    w = tl.load(w_ptr + row * stride_w + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row, _pick_in_chunk(w, offs, ok, x, below, V).to(tl.int64))


@triton.jit(do_not_specialize=["V", "C"])
def _softmax_stats_kernel(x_ptr, t_ptr, max_ptr, arg_ptr, sum_ptr, V, C, stride_x, BLOCK: tl.constexpr,
                          DRAW: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    m = tl.max(x, 0)
    tl.store(max_ptr + row * C + c, m)
    t = tl.load(t_ptr + row)
    ts = tl.where(t > 0, t, 1.0)
    if DRAW:  # the draws: the first argmax too, and the exponent as torch's softmax of logits / T rounds it
        tl.store(arg_ptr + row * C + c, tl.min(tl.where((x == m) & ok, offs, _BIG), 0))
        # x / T - max / T: torch's softmax of logits / T subtracts the max of the quotients, which is max / T
        # (division by T > 0 is monotone). Rounded divisions: Triton's default fp32 division is approximate, and
        # at T = 0.02 a logit of 40 is a quotient of 2,000 whose last-bit errors moved probabilities by 2e-4
        e = tl.where(ok, tl.exp(tl.math.div_rn(x, ts) - tl.math.div_rn(m, ts)), 0.0)
    else:
        # the logsumexp alone (verification): no draw depends on these sums bit for bit, and a multiply instead of
        # two rounded divisions per entry halved the kernel's time on the H200 (docs/perf.md); x - max is exact
        # for bf16 / fp16 logits, so the exponent is within 2 roundings of (x - max) / T
        e = tl.where(ok, tl.exp((x - m) * (1.0 / ts)), 0.0)
    tl.store(sum_ptr + row * C + c, tl.where(m == float("-inf"), 0.0, tl.sum(e, 0)))


@triton.jit(do_not_specialize=["V", "C"])
def _softmax_pick_kernel(x_ptr, t_ptr, u_ptr, max_ptr, arg_ptr, sum_ptr, tok_ptr, best_ptr, stat_ptr, V, C,
                         stride_x, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    co = tl.arange(0, BLOCK_C)
    okc = co < C
    mc = tl.load(max_ptr + row * C + co, mask=okc, other=float("-inf"))
    ac = tl.load(arg_ptr + row * C + co, mask=okc, other=_BIG)
    top = tl.max(mc, 0)
    best = tl.min(tl.where(okc & (mc == top), ac, _BIG), 0)
    tl.store(best_ptr + row, best.to(tl.int64))
    t = tl.load(t_ptr + row)
    ts = tl.where(t > 0, t, 1.0)
    sc = tl.load(sum_ptr + row * C + co, mask=okc, other=0.0)
    scale = tl.exp(tl.math.div_rn(mc, ts) - tl.math.div_rn(top, ts))
    sums = tl.where(okc & (mc > float("-inf")), sc * scale, 0.0)
    z = tl.sum(sums, 0)
    x = tl.load(u_ptr + row) * z
    chunk, below = _chunk_choice(sums, co, okc, x, C)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    xv = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    w = tl.where(ok, tl.exp(tl.math.div_rn(xv, ts) - tl.math.div_rn(top, ts)), 0.0)
    tok = tl.where(t > 0, _pick_in_chunk(w, offs, ok, x, below, V), best)
    tl.store(stat_ptr + row * 2, top)
    tl.store(stat_ptr + row * 2 + 1, z)
    tl.store(tok_ptr + row, tok.to(tl.int64))


@triton.jit(do_not_specialize=["V"])
def _softmax_probs_kernel(x_ptr, t_ptr, stat_ptr, best_ptr, out_ptr, V, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    t = tl.load(t_ptr + row)
    ts = tl.where(t > 0, t, 1.0)
    top = tl.load(stat_ptr + row * 2)
    z = tl.load(stat_ptr + row * 2 + 1)
    x = tl.load(x_ptr + row * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    q = tl.math.div_rn(tl.exp(tl.math.div_rn(x, ts) - tl.math.div_rn(top, ts)), z)
    onehot = tl.where(offs == tl.load(best_ptr + row), 1.0, 0.0)
    tl.store(out_ptr + row * stride_o + offs, tl.where(t > 0, q, onehot), mask=ok)


@triton.jit(do_not_specialize=["C"])
def _lse_combine_kernel(t_ptr, max_ptr, sum_ptr, out_ptr, C, BLOCK_C: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    co = tl.arange(0, BLOCK_C)
    okc = co < C
    mc = tl.load(max_ptr + row * C + co, mask=okc, other=float("-inf"))
    sc = tl.load(sum_ptr + row * C + co, mask=okc, other=0.0)
    t = tl.load(t_ptr + row)
    ts = tl.where(t > 0, t, 1.0)
    top = tl.max(mc, 0)
    scale = tl.exp((mc - top) * (1.0 / ts))
    z = tl.sum(tl.where(okc & (mc > float("-inf")), sc * scale, 0.0), 0)
    # max / T rounded as the caller's own l / T is (verification: p = exp(l / T - lse))
    tl.store(out_ptr + row, tl.math.div_rn(top, ts) + tl.log(z))


@triton.jit
def _target_probs(x_ptr, r, t_ptr, lse_ptr, offs, ok, stride_x):
    """p = exp(l / T - lse) of target row r at `offs` (0 outside the row)."""
    x = tl.load(x_ptr + r * stride_x + offs, mask=ok, other=float("-inf")).to(tl.float32)
    return tl.where(ok, tl.exp(tl.math.div_rn(x, tl.load(t_ptr + r)) - tl.load(lse_ptr + r)), 0.0)


@triton.jit(do_not_specialize=["V", "C"])
def _residual_sums_kernel(x_ptr, rows_ptr, t_ptr, lse_ptr, q_ptr, pos_ptr, rej_ptr, psum_ptr, rsum_ptr, alpha, V, C,
                          stride_x, stride_qb, stride_qn, BLOCK: tl.constexpr, HAS_Q: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    offs = c * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    p = _target_probs(x_ptr, tl.load(rows_ptr + b), t_ptr, lse_ptr, offs, ok, stride_x)
    tl.store(psum_ptr + b * C + c, tl.sum(p, 0))
    if HAS_Q:
        if tl.load(rej_ptr + b) != 0:  # a bonus draw (nothing rejected) reads p alone: no draft row
            q = tl.load(q_ptr + b * stride_qb + tl.load(pos_ptr + b) * stride_qn + offs, mask=ok, other=0.0)
            tl.store(rsum_ptr + b * C + c, tl.sum(tl.maximum(p - alpha * q, 0.0), 0))


@triton.jit(do_not_specialize=["V", "C"])
def _residual_pick_kernel(x_ptr, rows_ptr, t_ptr, lse_ptr, q_ptr, pos_ptr, rej_ptr, u_ptr, psum_ptr, rsum_ptr, out_ptr,
                          alpha, V, C, stride_x, stride_qb, stride_qn, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                          HAS_Q: tl.constexpr):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    co = tl.arange(0, BLOCK_C)
    okc = co < C
    sums = tl.load(psum_ptr + b * C + co, mask=okc, other=0.0)
    if HAS_Q:  # the residual's sums are 0 on rows without a rejection (not written); an all-zero residual draws p
        rs = tl.load(rsum_ptr + b * C + co, mask=okc, other=0.0)
        use_r = (tl.load(rej_ptr + b) != 0) & (tl.sum(rs, 0) > 0)
        sums = tl.where(use_r, rs, sums)
    x = tl.load(u_ptr + b) * tl.sum(sums, 0)
    chunk, below = _chunk_choice(sums, co, okc, x, C)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    w = _target_probs(x_ptr, tl.load(rows_ptr + b), t_ptr, lse_ptr, offs, ok, stride_x)
    if HAS_Q:
        q = tl.load(q_ptr + b * stride_qb + tl.load(pos_ptr + b) * stride_qn + offs, mask=ok, other=0.0)
        w = tl.where(use_r, tl.maximum(w - alpha * q, 0.0), w)
    tl.store(out_ptr + b, _pick_in_chunk(w, offs, ok, x, below, V).to(tl.int64))


def _rows(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _grid(v: int) -> tuple[int, int, int]:
    """(chunk entries, chunks per row, warps) for rows of v entries."""
    block = min(CHUNK, next_pow2(v))
    return block, cdiv(v, block), 8 if block >= 2048 else 4


def _chunk_stats(x: Tensor, t: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per (row, chunk) max, first argmax and sum of exp((x - max) / T): `[N, C]` each."""
    n, v = x.shape
    block, c, warps = _grid(v)
    maxes = torch.empty((n, c), dtype=torch.float32, device=x.device)
    args = torch.empty((n, c), dtype=torch.int32, device=x.device)
    sums = torch.empty((n, c), dtype=torch.float32, device=x.device)
    _softmax_stats_kernel[(n, c)](x, t, maxes, args, sums, v, c, x.stride(0), BLOCK=block, DRAW=True, num_warps=warps)
    return maxes, args, sums


def inverse_cdf_sample(weights: Tensor, uniforms: Tensor) -> Tensor:
    """weights [N, V] bf16|fp16|fp32 (>= 0), uniforms [N] float32 -> [N] int64 (`reference.inverse_cdf_sample`)."""
    n, v = weights.shape
    out = torch.empty((n,), dtype=torch.int64, device=weights.device)
    if n == 0:
        return out
    w = _rows(weights)
    u = uniforms.to(torch.float32).contiguous()
    check_launchable("inverse_cdf_sample", _weight_sums_kernel, w, u)
    block, c, warps = _grid(v)
    sums = torch.empty((n, c), dtype=torch.float32, device=w.device)
    _weight_sums_kernel[(n, c)](w, sums, v, c, w.stride(0), BLOCK=block, num_warps=warps)
    _weight_pick_kernel[(n,)](w, u, sums, out, v, c, w.stride(0), BLOCK=block, BLOCK_C=next_pow2(c), num_warps=warps)
    return out


def softmax_sample(logits: Tensor, temperature: Tensor | None, uniforms: Tensor | None, *,
                   probs_out: Tensor | None = None) -> tuple[Tensor, Tensor]:  # fmt: skip
    """logits [N, V] float32 (last dim contiguous), temperature / uniforms [N] float32 or None, probs_out [N, V]
    float32 (last dim contiguous, may alias logits) -> (tokens, argmax) [N] int64 (`reference.softmax_sample`)."""
    if temperature is None:  # every row greedy: the argmax alone
        best = greedy_argmax(logits)
        return best, best
    n, v = logits.shape
    dev = logits.device
    tokens = torch.empty((n,), dtype=torch.int64, device=dev)
    best = torch.empty((n,), dtype=torch.int64, device=dev)
    if n == 0:
        return tokens, best
    x = _rows(logits)
    t = temperature.to(torch.float32).contiguous()
    u = uniforms.to(torch.float32).contiguous()
    check_launchable("softmax_sample", _softmax_stats_kernel, x, t, u)
    block, c, warps = _grid(v)
    maxes, args, sums = _chunk_stats(x, t)
    stats = torch.empty((n, 2), dtype=torch.float32, device=dev)
    _softmax_pick_kernel[(n,)](x, t, u, maxes, args, sums, tokens, best, stats, v, c, x.stride(0), BLOCK=block,
                               BLOCK_C=next_pow2(c), num_warps=warps)  # fmt: skip
    if probs_out is not None:
        _softmax_probs_kernel[(n, c)](x, t, stats, best, probs_out, v, x.stride(0), probs_out.stride(0), BLOCK=block,
                                      num_warps=warps)  # fmt: skip
    return tokens, best


def logsumexp_rows(logits: Tensor, temperature: Tensor) -> Tensor:
    """logits [R, V] bf16|fp16|fp32, temperature [R] float32 > 0 -> [R] float32 (`reference.logsumexp_rows`): one
    read of the logits (`_softmax_stats_kernel`'s DRAW=False variant), nothing of [R, V] written."""
    n, v = logits.shape
    out = torch.empty((n,), dtype=torch.float32, device=logits.device)
    if n == 0:
        return out
    x = _rows(logits)
    t = temperature.to(torch.float32).contiguous()
    check_launchable("logsumexp_rows", _softmax_stats_kernel, x, t)
    block, c, _ = _grid(v)
    maxes = torch.empty((n, c), dtype=torch.float32, device=x.device)
    sums = torch.empty((n, c), dtype=torch.float32, device=x.device)
    # 4 warps: the fastest of 4 / 8 warps x 2,048 / 4,096 / 8,192 entries timed at 1,536 rows of 129,280 (H200);
    # no argmax: arg_ptr is not read (maxes stands in)
    _softmax_stats_kernel[(n, c)](x, t, maxes, maxes, sums, v, c, x.stride(0), BLOCK=block, DRAW=False, num_warps=4)
    _lse_combine_kernel[(n,)](t, maxes, sums, out, c, BLOCK_C=next_pow2(c), num_warps=1)
    return out


def residual_sample(logits: Tensor, rows: Tensor, temperature: Tensor, lse: Tensor, draft_probs: Tensor | None,
                    positions: Tensor | None, rejected: Tensor, uniforms: Tensor, alpha: float = 1.0) -> Tensor:
    """`reference.residual_sample` without writing a `[B, V]` distribution: per (request, chunk) the sums of p and
    of the residual, then per request the chunk where u * total falls and a scan of that chunk (p read as
    exp(l / T - lse)). logits [R, V] bf16|fp16|fp32 (last dim contiguous), draft_probs [B, N, V] float32 (last
    dim contiguous) or None."""
    b = rows.shape[0]
    out = torch.empty((b,), dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    x = _rows(logits)
    v = x.shape[1]
    t = temperature.to(torch.float32).contiguous()
    lse = lse.to(torch.float32).contiguous()
    u = uniforms.to(torch.float32).contiguous()
    rows = rows.to(torch.int64).contiguous()
    has_q = draft_probs is not None
    q = draft_probs if has_q else u  # a stand-in pointer, never read without HAS_Q
    pos = positions.to(torch.int64).contiguous() if has_q else rows
    rej = rejected.to(torch.int8).contiguous()
    check_launchable("residual_sample", _residual_sums_kernel, x, rows, t, lse, q, pos, rej, u)
    block, c, warps = _grid(v)
    psum = torch.empty((b, c), dtype=torch.float32, device=x.device)
    rsum = torch.zeros((b, c), dtype=torch.float32, device=x.device) if has_q else psum
    sq = (q.stride(0), q.stride(1)) if has_q else (0, 0)
    _residual_sums_kernel[(b, c)](x, rows, t, lse, q, pos, rej, psum, rsum, float(alpha), v, c, x.stride(0), *sq,
                                  BLOCK=block, HAS_Q=has_q, num_warps=warps)  # fmt: skip
    _residual_pick_kernel[(b,)](x, rows, t, lse, q, pos, rej, u, psum, rsum, out, float(alpha), v, c, x.stride(0), *sq,
                                BLOCK=block, BLOCK_C=next_pow2(c), HAS_Q=has_q, num_warps=warps)  # fmt: skip
    return out
