"""TileLang backend of sparse MQA decode attention with attn_sink: one CTA per token, warp-specialised (sm_90a).

Why a second backend: the Triton kernel (triton.py) runs every role in the same warps, so each tile's gather, score
dot, softmax and value dot follow each other and at most a few gathers are in flight; at 256 tokens it stays well
behind FlashMLA (docs/perf.md "Sparse decode attention"). Here the roles run in separate warpgroups that meet at
mbarriers, the structure of FlashMLA's sparse decode:
- warpgroup 2 (producer, few registers) gathers the rows of tile j into one of the shared tile buffers with
  cp.async, reading each row's index itself (so the index list never passes through the consumers);
- warpgroup 0 computes the scores S = Q K^T of the tile over all of D, the online softmax, and its half of the
  output columns O[:, :D/2] += P V[:, :D/2];
- warpgroup 1 rescales and accumulates the other half O[:, D/2:] += P V[:, D/2:] from the P and the rescale factor
  warpgroup 0 leaves in shared memory.
While warpgroup 1 multiplies tile j, warpgroup 0 already scores tile j + 1 and the producer gathers tile j + 2.

Shapes: q [T, H, D] bf16 with H == 64 and D == 512 (one CTA holds all heads of a token: every gathered row feeds
M = 64 tensor-core rows), kv [S, D] bf16, indices [T, K] int64; an optional second source kv2 [S2, D] /
indices2 [T, K2] extends each token's list (the window ring + the compressed store at decode). Indices < 0 or past
their source's rows are invalid: their score is -inf and their tile row is zero-filled by the copy itself (no read;
shared memory then never holds uninitialised values that 0 * NaN would carry into the output). The sink enters as
the initial running max and denominator, as in the Triton kernel and the torch reference. Scores and softmax are fp32 in the log2 domain; P is
rounded to bf16 for the value dot (FlashAttention's convention, as the Triton kernel).

tilelang is an optional dependency (`deepinfer-kernels[tilelang]`), imported only inside functions; kernels are
compiled once per (heads, dim, scale) in this process and on disk by tilelang's own cache.
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel's parameter annotations, which name
# symbolic sizes local to build_kernel.
import functools
from types import SimpleNamespace

import torch
from torch import Tensor

__all__ = [
    "BLOCK_ROWS",
    "BUFFER_ROWS",
    "HEADS",
    "HEAD_DIM",
    "build_kernel",
    "pass_configs",
    "sparse_attn",
    "supports",
    "tilelang_available",
]

HEADS = 64
HEAD_DIM = 512
BLOCK_ROWS = 64  # rows per gathered tile: 64 or 32 (both checked against the reference on the H200; 64 faster)
BUFFER_ROWS = 128  # rows of all tile buffers together: 128 KiB, + Q 64 KiB + P fill 200 KiB of an SM's 227 KiB
_LOG2E = 1.4426950408889634


@functools.cache  # a failed import is not cached by Python: without this every eager call would search sys.path
def tilelang_available() -> bool:
    """True when `import tilelang` succeeds (it is an optional extra)."""
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return False
    return True


def supports(q: Tensor, kv: Tensor, indices: Tensor, kv2: Tensor | None) -> bool:
    """Whether this kernel handles these inputs: CUDA sm_90, bf16, H == 64, D == 512, a non-empty first source and
    index list (the producer's clamped index loads read column 0 of it)."""
    return (
        q.is_cuda
        and q.dtype == torch.bfloat16
        and kv.dtype == torch.bfloat16
        and (kv2 is None or kv2.dtype == torch.bfloat16)
        and q.dim() == 3
        and q.shape[1] == HEADS
        and q.shape[2] == HEAD_DIM
        and kv.shape[0] > 0
        and indices.shape[1] > 0
        and torch.cuda.get_device_capability(q.device) == (9, 0)
    )


def build_kernel(heads: int, dim: int, softmax_scale: float, two_sources: bool, block_rows: int = BLOCK_ROWS):
    """The TileLang prim_func for (heads, dim, softmax_scale, two_sources); T, S, S2, K, K2 stay symbolic (the
    one-source kernel never reads kv2 / indices2).
    Arguments of the compiled kernel: q, kv, indices, kv2, indices2, sink, out (out is written, not returned)."""
    import tilelang.language as T

    H, D, BI = heads, dim, block_rows
    n_buf = BUFFER_ROWS // BI
    D2 = D // 2
    qk_scale = float(softmax_scale) * _LOG2E
    bf16, f32, i64 = "bfloat16", "float32", "int64"
    n_tok, s1, s2, k1, k2 = T.dynamic("n_tok, s1, s2, k1, k2")
    row_threads = 8  # producer threads per gathered row (each moves 2 x 4 x 16 B of it)
    rows_per_pass = 128 // row_threads
    passes = BI // rows_per_pass
    chunks = D2 // (8 * row_threads)  # 16-byte copies per thread per row half

    # The macros below are expanded in place once per buffer, so every buffer index is static in the generated
    # code; `v` carries the kernel's buffers and thread values (a namespace built inside the kernel).
    def each_buffer(step, v, g):
        """Expands `step` once per buffer (plain Python: the buffer lists are indexed statically)."""
        for b in range(n_buf):
            step(v, v.ready[b], v.ok[b], v.k_l[b], v.k_r[b], v.free[b], g, n_buf * g + b)

    @T.macro
    def score_tile(v, ready, ok, k_l, k_r, free, p, j):
        T.barrier_wait(ready, p & 1)
        for h, n in T.Parallel(H, BI):
            v.acc_s[h, n] = T.if_then_else(ok[n], 0, -T.infinity(f32))
        T.wgmma_gemm(v.q_l, k_l, v.acc_s, transpose_B=True)
        T.wgmma_gemm(v.q_r, k_r, v.acc_s, transpose_B=True)
        T.wait_wgmma(0)
        if j > 0:  # warpgroup 1 is done with the previous P and alpha
            T.barrier_arrive(v.p_free)
            T.barrier_wait(v.p_free, (j & 1) ^ 1)
        T.copy(v.m_i, v.m_prev)
        for h, n in T.Parallel(H, BI):
            v.acc_s[h, n] = v.acc_s[h, n] * qk_scale
        T.reduce_max(v.acc_s, v.m_i, dim=1, clear=False)
        for h in T.Parallel(H):
            v.alpha[h] = T.exp2(v.m_prev[h] - v.m_i[h])
        for h, n in T.Parallel(H, BI):
            v.acc_s[h, n] = T.exp2(v.acc_s[h, n] - v.m_i[h])
        T.reduce_sum(v.acc_s, v.row_sum, dim=1)
        for h in T.Parallel(H):
            v.l_i[h] = v.l_i[h] * v.alpha[h] + v.row_sum[h]
        for h, d in T.Parallel(H, D2):
            v.acc_l[h, d] = v.acc_l[h, d] * v.alpha[h]
        T.copy(v.alpha, v.alpha_sh)
        T.copy(v.acc_s, v.p_sh)
        T.barrier_arrive(v.p_ready)  # before this warpgroup's own value dot: both halves then run together
        T.gemm(v.p_sh, k_l, v.acc_l)
        T.barrier_arrive(free)

    @T.macro
    def value_tile(v, ready, ok, k_l, k_r, free, p, j):
        T.barrier_arrive(v.p_ready)
        T.barrier_wait(v.p_ready, j & 1)
        T.fence_proxy_async()  # the tile's rows were written by cp.async (generic proxy); wgmma reads them
        for h, d in T.Parallel(H, D2):
            v.acc_r[h, d] = v.acc_r[h, d] * v.alpha_sh[h]
        T.gemm(v.p_sh, k_r, v.acc_r)
        T.barrier_arrive(free)
        if j < v.last:
            T.barrier_arrive(v.p_free)

    @T.macro
    def gather_tile(v, ready, ok, k_l, k_r, free, p, j):
        # The tile's indices first: unconditional (clamped) loads that are all in flight together and overlap the
        # wait for the buffer; a dependent index load before each row's copies would serialise their latencies.
        for r in T.unroll(passes):
            col = j * BI + r * rows_per_pass + v.lane // row_threads
            x1 = v.Idx[v.bx, T.min(col, k1 - 1)]
            in1 = col < k1 and x1 >= 0 and x1 < T.cast(s1, i64)
            if two_sources:
                x2 = v.Idx2[v.bx, T.max(T.min(col - k1, k2 - 1), 0)]
                in2 = col >= k1 and col < k1 + k2 and x2 >= 0 and x2 < T.cast(s2, i64)
                v.idx[r] = T.if_then_else(in1, x1, T.if_then_else(in2, x2, T.int64(0)))
                v.src[r] = T.if_then_else(in1, 1, T.if_then_else(in2, 2, 0))
            else:
                v.idx[r] = T.if_then_else(in1, x1, T.int64(0))
                v.src[r] = T.if_then_else(in1, 1, 0)
        T.barrier_wait(free, (p & 1) ^ 1)
        for r in T.unroll(passes):
            row = r * rows_per_pass + v.lane // row_threads
            ok[row] = v.src[r] > 0
            # 16-byte cp.async per (thread, chunk); an invalid row is zero-filled without a read (a shared
            # dummy row would become a hot spot: short sequences have mostly -1 indices). The mbarrier arrive
            # below completes when every copy has landed.
            for u in T.unroll(chunks):
                cl = u * 64 + v.c0
                if two_sources and v.src[r] == 2:
                    T.ptx_cp_async(T.access_ptr(k_l[row, cl], "w", 8), T.access_ptr(v.KV2[v.idx[r], cl], "r", 8), 8)
                    T.ptx_cp_async(
                        T.access_ptr(k_r[row, cl], "w", 8), T.access_ptr(v.KV2[v.idx[r], D2 + cl], "r", 8), 8
                    )
                else:
                    live = v.src[r] > 0
                    T.ptx_cp_async(
                        T.access_ptr(k_l[row, cl], "w", 8), T.access_ptr(v.KV[v.idx[r], cl], "r", 8), 8, live
                    )
                    T.ptx_cp_async(
                        T.access_ptr(k_r[row, cl], "w", 8), T.access_ptr(v.KV[v.idx[r], D2 + cl], "r", 8), 8, live
                    )
        # Two arrivals per producer thread complete a buffer's phase: a plain arrive (release: the validity flags
        # written above) and the copy-tracking one (fires when this thread's copies have landed).
        T.barrier_arrive(ready)
        T.cp_async_barrier_noinc(ready)

    @T.prim_func
    def kernel(
        Q: T.Tensor([n_tok, H, D], bf16),
        KV: T.Tensor([s1, D], bf16),
        Idx: T.Tensor([n_tok, k1], i64),
        KV2: T.Tensor([s2, D], bf16),
        Idx2: T.Tensor([n_tok, k2], i64),
        Sink: T.Tensor([H], f32),
        Out: T.Tensor([n_tok, H, D], bf16),
    ):
        with T.Kernel(n_tok, threads=384) as bx:
            q_l = T.alloc_shared([H, D2], bf16)
            q_r = T.alloc_shared([H, D2], bf16)
            k_l = [T.alloc_shared([BI, D2], bf16) for _ in range(n_buf)]
            k_r = [T.alloc_shared([BI, D2], bf16) for _ in range(n_buf)]
            ok = [T.alloc_shared([BI], "bool") for _ in range(n_buf)]
            p_sh = T.alloc_shared([H, BI], bf16)
            alpha_sh = T.alloc_shared([H], f32)
            l_sh = T.alloc_shared([H], f32)

            acc_s = T.alloc_fragment([H, BI], f32)
            acc_l = T.alloc_fragment([H, D2], f32)
            acc_r = T.alloc_fragment([H, D2], f32)
            m_i = T.alloc_fragment([H], f32)
            m_prev = T.alloc_fragment([H], f32)
            alpha = T.alloc_fragment([H], f32)
            row_sum = T.alloc_fragment([H], f32)
            l_i = T.alloc_fragment([H], f32)
            idx = T.alloc_local([passes], i64)
            src = T.alloc_local([passes], "int32")

            ready = [T.alloc_barrier(arrive_count=256) for _ in range(n_buf)]
            free = [T.alloc_barrier(arrive_count=256) for _ in range(n_buf)]
            p_ready = T.alloc_barrier(arrive_count=256)
            p_free = T.alloc_barrier(arrive_count=256)
            done = T.alloc_barrier(arrive_count=256)

            # tiles come in groups of n_buf (one per buffer); trailing tiles past K are all invalid: no effect
            # (the one-source kernel's placeholder indices2 has k2 columns that are not part of the list)
            n_groups = T.ceildiv(k1 + k2 if two_sources else k1, n_buf * BI)
            tx = T.get_thread_binding()
            lane = tx - 256
            v = SimpleNamespace(
                q_l=q_l, q_r=q_r, acc_s=acc_s, acc_l=acc_l, acc_r=acc_r, m_i=m_i, m_prev=m_prev, alpha=alpha,
                row_sum=row_sum, l_i=l_i, alpha_sh=alpha_sh, p_sh=p_sh, p_ready=p_ready, p_free=p_free, idx=idx,
                src=src, Idx=Idx, Idx2=Idx2, KV=KV, KV2=KV2, bx=bx, lane=lane, c0=(lane % row_threads) * 8,
                k_l=k_l, k_r=k_r, ok=ok, ready=ready, free=free, last=n_buf * n_groups - 1,
            )

            if tx < 128:  # scores, softmax, left half of the output
                T.set_max_nreg(240, 1)
                for h in T.Parallel(H):
                    m_i[h] = Sink[h] * _LOG2E
                    l_i[h] = 1.0
                T.fill(acc_l, 0)
                # Q is loaded by this warpgroup alone, so the producer starts gathering at once
                T.copy(Q[bx, 0:H, 0:D2], q_l)
                T.copy(Q[bx, 0:H, D2:D], q_r)
                for g in T.serial(n_groups):
                    each_buffer(score_tile, v, g)
                T.copy(l_i, l_sh)
                T.barrier_arrive(done)
                for h, d in T.Parallel(H, D2):
                    acc_l[h, d] = acc_l[h, d] / l_i[h]
                T.copy(acc_l, q_l)
                T.copy(q_l, Out[bx, 0:H, 0:D2])
            elif tx < 256:  # right half of the output
                T.set_max_nreg(168, 1)
                T.fill(acc_r, 0)
                for g in T.serial(n_groups):
                    each_buffer(value_tile, v, g)
                T.barrier_arrive(done)
                T.barrier_wait(done, 0)
                for h, d in T.Parallel(H, D2):
                    acc_r[h, d] = acc_r[h, d] / l_sh[h]
                T.copy(acc_r, q_r)
                T.copy(q_r, Out[bx, 0:H, D2:D])
            else:  # producer: gathers tile j into buffer j % n_buf
                T.set_max_nreg(80, 0)
                for g in T.serial(n_groups):
                    each_buffer(gather_tile, v, g)

    return kernel


def pass_configs() -> dict:
    """TileLang pass options of this kernel. The gathers' row indices are data: the safe-memory pass cannot prove
    them in bounds and would turn every cp.async into a guarded synchronous load, so it is off (the producer
    range-checks each index itself). TIR_USE_ASYNC_COPY is the setting every measurement ran with; the gathers
    issue their cp.async explicitly either way."""
    import tilelang

    return {
        tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
        tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
        tilelang.PassConfigKey.TIR_USE_ASYNC_COPY: True,
    }


@functools.cache
def _compiled(heads: int, dim: int, softmax_scale: float, two_sources: bool, block_rows: int):
    import tilelang

    func = build_kernel(heads, dim, softmax_scale, two_sources, block_rows)
    return tilelang.compile(
        func,
        out_idx=None,
        target="cuda",
        pass_configs=pass_configs(),
    )


def sparse_attn(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    attn_sink: Tensor,
    softmax_scale: float,
    *,
    kv2: Tensor | None = None,
    indices2: Tensor | None = None,
    block_rows: int = BLOCK_ROWS,
) -> Tensor:
    """q [T, 64, 512] bf16; kv [S, 512] bf16; indices [T, K] int64 (-1 / out of range = none); attn_sink [64];
    kv2 [S2, 512] / indices2 [T, K2]: an optional second source -> [T, 64, 512] bf16. Inputs are validated by
    the package dispatcher, which also checks `supports` first. block_rows (32 or 64): rows per gathered tile,
    with BUFFER_ROWS // block_rows tiles in flight (benchmark sweeps)."""
    if block_rows not in (32, 64):  # 16-row tiles compile (slowly) but were never run on a GPU
        raise ValueError(f"sparse_attn (tilelang): block_rows {block_rows}, expected 32 or 64")
    t = q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    if t == 0:
        return out
    two = kv2 is not None and kv2.shape[0] > 0 and indices2.shape[1] > 0
    if not two:  # placeholders the one-source kernel never reads
        kv2, indices2 = kv, indices
    kernel = _compiled(q.shape[1], q.shape[2], float(softmax_scale), two, block_rows)
    kernel(
        q.contiguous(),
        kv.contiguous(),
        indices.contiguous(),
        kv2.contiguous(),
        indices2.contiguous(),
        attn_sink.float().contiguous(),
        out,
    )
    return out
