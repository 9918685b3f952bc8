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

Record sources (kv_format / kv2_format): either source may instead be the cache's deployed records, uint8
[S, 528] MXFP8_E4M3 (the window) or [S, 288] NVFP4_E2M1 (the compressed store), rows of codes then scale bytes
(`deepinfer_kernels.quant.kv_formats`). The producer then loads each row's bytes with plain vector loads into
registers, decodes them and stores the bf16 tile the consumers already read (FlashMLA's structure for FP8 KV): the
gather moves 528 or 288 bytes per row instead of 1,024, and no decoded copy of the cache is written first. The
decoded values equal `decode_records(rec, fmt, torch.bfloat16)` (the product code x scale is exact in bf16).

tilelang is an optional dependency (`deepinfer-kernels[tilelang]`), imported only inside functions; kernels are
compiled once per (heads, dim, scale, sources, formats) in this process and on disk by tilelang's own cache.
"""

# No `from __future__ import annotations`: TileLang evaluates the kernel's parameter annotations, which name
# symbolic sizes local to build_kernel.
import functools
from types import SimpleNamespace

import torch
from torch import Tensor

from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3, NVFP4_E2M1, KVFormat

__all__ = [
    "BLOCK_ROWS",
    "BUFFER_ROWS",
    "FMT_BF16",
    "FMT_MXFP8",
    "FMT_NVFP4",
    "HEADS",
    "HEAD_DIM",
    "STAGED_BLOCK_ROWS",
    "STAGE_SLOTS",
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

# Row formats of a source in build_kernel (fmt1 / fmt2): bf16 values, or uint8 records of that KVFormat.
FMT_BF16, FMT_MXFP8, FMT_NVFP4 = 0, 1, 2
_FORMATS = {FMT_MXFP8: MXFP8_E4M3, FMT_NVFP4: NVFP4_E2M1}
# Producer registers (setmaxnreg). The three warpgroups start at the launch bound's 168 and can only trade among
# themselves (384 x 168 is the CTA's whole allocation), so 240 + 168 + producer <= 3 x 168: at most 96. The copy
# producer needs few; the record producer holds two passes of row bytes (2 x 20 words) plus its addresses.
_PRODUCER_REGS = 80
_PRODUCER_REGS_RECORDS = 96
# Record passes whose loads are issued together before any of them is decoded: latency hiding against registers.
# Two passes = 32 rows (17 KB of MXFP8) in flight per SM, the most that 96 producer registers hold without a spill
# in ptxas (the words alone of four passes would take 80).
_RECORD_PASSES_IN_FLIGHT = 2
_RECORD_WORDS = 20  # 32-bit registers per pass: MXFP8 16 code + 4 scale words; NVFP4 8 code + 8 scale words
# The staged record producer (build_kernel(staged=True)): raw record rows go global -> shared by cp.async into
# STAGE_SLOTS slots of one tile each, issued STAGE_SLOTS - 1 tiles ahead of the tile being decoded, so up to
# 4 x 32 rows per SM are in flight without holding registers. Its shared memory: Q 64 KiB + two 32-row bf16 tiles
# 64 KiB + the slots 4 x 32 x 528 B = 66 KiB + P 4 KiB, within an SM's 227 KiB.
STAGE_SLOTS = 4
STAGED_BLOCK_ROWS = 32
STAGED_BUFFER_ROWS = 64

# Decode of one thread's 8-column chunk, in CUDA (the kernel's prelude): TileLang has no e4m3x2 conversion
# intrinsic, and the 16-byte shared store must be one st.shared.v4. e4m3 goes through cvt.rn.f16x2.e4m3x2 (exact,
# subnormals included: every e4m3 value is a normal f16), then float32 times the scale, then one rounding to bf16
# (exact: a 4-bit e4m3 or 2-bit e2m1 significand times a power of two or 4-bit e4m3 scale fits bf16's 8 bits).
# sm_90 has no e2m1 conversion: an e2m1 nibble (s, e1 e0, m) becomes the e4m3 code (s, 00 e1 e0, m 00), whose
# value is the e2m1 value times 2^-6 for normal and subnormal codes alike, and the scale carries the 2^6 back.
# Under fast math the float32 product flushes results below 2^-126 to zero (the torch decode keeps them); the
# quantizer's amax floors keep every scale at or above 2^-22, so no decoded value comes near that.
_DECODE_CUDA = r"""
// Predicated in-place loads through the read-only path: where pred is false the words keep their value, so a
// two-format kernel loads each row through both formats' loads into the same registers (exactly one applies).
__device__ __forceinline__ void dk_ldg32(unsigned *w, const void *p, int pred) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %2, 0;\n@q ld.global.nc.u32 %0, [%1];\n}"
               : "+r"(w[0]) : "l"(p), "r"(pred));
}
__device__ __forceinline__ void dk_ldg64(unsigned *w, const void *p, int pred) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %3, 0;\n@q ld.global.nc.v2.u32 {%0, %1}, [%2];\n}"
               : "+r"(w[0]), "+r"(w[1]) : "l"(p), "r"(pred));
}
__device__ __forceinline__ void dk_ldg128(unsigned *w, const void *p, int pred) {
  asm volatile("{\n.reg .pred q;\nsetp.ne.b32 q, %5, 0;\n@q ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n}"
               : "+r"(w[0]), "+r"(w[1]), "+r"(w[2]), "+r"(w[3]) : "l"(p), "r"(pred));
}
__device__ __forceinline__ void dk_sts128(void *dst, unsigned a, unsigned b, unsigned c, unsigned d) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};"
               :: "r"((unsigned)__cvta_generic_to_shared(dst)), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}
__device__ __forceinline__ void dk_f16x2_f32(unsigned h, float &lo, float &hi) {
  asm("{\n.reg .b16 l, u;\nmov.b32 {l, u}, %2;\ncvt.f32.f16 %0, l;\ncvt.f32.f16 %1, u;\n}"
      : "=f"(lo), "=f"(hi) : "r"(h));
}
__device__ __forceinline__ unsigned dk_bf16x2(float lo, float hi) {
  unsigned r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
// 4 e4m3 codes (byte i = column i) times s -> 4 bf16 in 2 words, column 0 in the low half of w0
__device__ __forceinline__ void dk_e4m3x4(unsigned c, float s, unsigned &w0, unsigned &w1) {
  unsigned h0, h1;
  asm("{\n.reg .b16 l, u;\nmov.b32 {l, u}, %2;\ncvt.rn.f16x2.e4m3x2 %0, l;\ncvt.rn.f16x2.e4m3x2 %1, u;\n}"
      : "=r"(h0), "=r"(h1) : "r"(c));
  float f0, f1, f2, f3;
  dk_f16x2_f32(h0, f0, f1);
  dk_f16x2_f32(h1, f2, f3);
  w0 = dk_bf16x2(f0 * s, f1 * s);
  w1 = dk_bf16x2(f2 * s, f3 * s);
}
// MXFP8: 8 e4m3 codes (c03: columns 0-3, c47: columns 4-7); the UE8M0 byte in bits 0-7 of `scale`
__device__ __forceinline__ void dk_st_mxfp8(void *dst, unsigned c03, unsigned c47, unsigned scale) {
  float s = __uint_as_float((scale & 0xFFu) << 23);
  unsigned w0, w1, w2, w3;
  dk_e4m3x4(c03, s, w0, w1);
  dk_e4m3x4(c47, s, w2, w3);
  dk_sts128(dst, w0, w1, w2, w3);
}
// NVFP4: 8 e2m1 codes (byte i: column 2i in the low nibble, 2i + 1 in the high); the e4m3 byte in bits 0-7 of `scale`
__device__ __forceinline__ void dk_st_nvfp4(void *dst, unsigned codes, unsigned scale) {
  unsigned even = ((codes << 4) & 0x80808080u) | ((codes << 2) & 0x1C1C1C1Cu);
  unsigned odd = (codes & 0x80808080u) | ((codes >> 2) & 0x1C1C1C1Cu);
  unsigned hs;
  asm("{\n.reg .b16 l, u;\nmov.b32 {l, u}, %1;\ncvt.rn.f16x2.e4m3x2 %0, l;\n}" : "=r"(hs) : "r"(scale & 0xFFu));
  float s, unused;
  dk_f16x2_f32(hs, s, unused);
  s *= 64.0f;
  unsigned w0, w1, w2, w3;
  dk_e4m3x4(__byte_perm(even, odd, 0x5140), s, w0, w1);
  dk_e4m3x4(__byte_perm(even, odd, 0x7362), s, w2, w3);
  dk_sts128(dst, w0, w1, w2, w3);
}
__device__ __forceinline__ void dk_st_zero(void *dst) { dk_sts128(dst, 0u, 0u, 0u, 0u); }
"""
# The staged producer's shared-memory side (appended to the prelude of staged kernels only): loads of one record row
# that cp.async left in shared memory into registers, which the register decodes above then read.
_DECODE_STAGED_CUDA = r"""
// cp.async groups as plain PTX: TileLang's own wait-group op is followed by a thread-range barrier of its choosing
// (0.1.15 emitted one with warpgroup 0's barrier id inside the producer branch); the producer orders its lanes itself.
__device__ __forceinline__ void dk_cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N> __device__ __forceinline__ void dk_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" :: "n"(N) : "memory");
}
// Shared memory by address: TileLang's thread-sync pass does not see these accesses, so it adds no producer-wide
// barriers for them (it put five per tile, one after each row-id store, around the stage slots). Every such access is
// within one thread (row ids) or between the 8 lanes of one row, all in one warp, which the producer orders itself
// with its cp.async waits and __syncwarp. The asm is volatile with a memory clobber, so none of them moves across
// those waits or across the decode's shared stores.
__device__ __forceinline__ unsigned dk_smem(const void *p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void dk_cp16(unsigned dst, const void *src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" :: "r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void dk_st_s32(unsigned a, int v) {
  asm volatile("st.shared.b32 [%0], %1;" :: "r"(a), "r"(v) : "memory");
}
__device__ __forceinline__ int dk_ld_s32(unsigned a) {
  int v;
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(a) : "memory");
  return v;
}
__device__ __forceinline__ void dk_st_s8(unsigned a, int v) {
  asm volatile("st.shared.b8 [%0], %1;" :: "r"(a), "h"((unsigned short)v) : "memory");
}
// A row's words into registers, all issued before any decode uses them.
__device__ __forceinline__ void dk_lds32(unsigned *w, unsigned a) {
  asm volatile("ld.shared.b32 %0, [%1];" : "=r"(w[0]) : "r"(a) : "memory");
}
__device__ __forceinline__ void dk_lds64(unsigned *w, unsigned a) {
  asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "r"(a) : "memory");
}
__device__ __forceinline__ void dk_lds128(unsigned *w, unsigned a) {
  asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "r"(a)
               : "memory");
}
"""


@functools.cache  # a failed import is not cached by Python: without this every eager call would search sys.path
def tilelang_available() -> bool:
    """True when `import tilelang` succeeds (it is an optional extra)."""
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return False
    return True


def supports(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    kv2: Tensor | None,
    kv_format: KVFormat | None = None,
    kv2_format: KVFormat | None = None,
) -> bool:
    """Whether this kernel handles these inputs: CUDA sm_90, bf16 q with H == 64, D == 512, a non-empty first source
    and index list (the producer's clamped index loads read column 0 of it), and each source either bf16 [S, 512]
    (format None) or uint8 records of MXFP8_E4M3 [S, 528] / NVFP4_E2M1 [S, 288] whose rows are 16-byte aligned
    (the producer's vector loads)."""
    return (
        q.is_cuda
        and q.dtype == torch.bfloat16
        and _source_ok(kv, kv_format)
        and (kv2 is None or _source_ok(kv2, kv2_format))
        and q.dim() == 3
        and q.shape[1] == HEADS
        and q.shape[2] == HEAD_DIM
        and kv.shape[0] > 0
        and indices.shape[1] > 0
        and torch.cuda.get_device_capability(q.device) == (9, 0)
    )


def _source_ok(src: Tensor, fmt: KVFormat | None) -> bool:
    if fmt is None:
        return src.dtype == torch.bfloat16
    if fmt not in _FORMATS.values():
        return False
    # a non-contiguous source is copied by sparse_attn (aligned); a contiguous one is read where it lies
    aligned = not src.is_contiguous() or src.data_ptr() % 16 == 0
    return src.dtype == torch.uint8 and src.dim() == 2 and src.shape[1] == fmt.record_bytes(HEAD_DIM) and aligned


def _format_code(fmt: KVFormat | None) -> int:
    if fmt is None:
        return FMT_BF16
    for code, f in _FORMATS.items():
        if f == fmt:
            return code
    raise ValueError(f"sparse_attn (tilelang): record format {fmt.name} is not decoded here; MXFP8_E4M3 or NVFP4_E2M1")


def build_kernel(
    heads: int,
    dim: int,
    softmax_scale: float,
    two_sources: bool,
    block_rows: int = BLOCK_ROWS,
    fmt1: int = FMT_BF16,
    fmt2: int = FMT_BF16,
    staged: bool = False,
):
    """The TileLang prim_func for (heads, dim, softmax_scale, two_sources, fmt1, fmt2); T, S, S2, K, K2 stay symbolic
    (the one-source kernel never reads kv2 / indices2, and declares it in kv's format: the caller passes kv again).
    fmt1 / fmt2: FMT_BF16 (kv [S, D] bf16), FMT_MXFP8 (uint8 [S, 528]) or FMT_NVFP4 (uint8 [S, 288]); records
    need D == 512. staged (record sources only, 32-row tiles): the producer stages raw record rows in shared
    memory with cp.async several tiles ahead and decodes them from there (STAGE_SLOTS), instead of loading a
    few passes of rows into registers at a time.
    Arguments of the compiled kernel: q, kv, indices, kv2, indices2, sink, out (out is written, not returned)."""
    import tilelang.language as T

    H, D, BI = heads, dim, block_rows
    n_buf = (STAGED_BUFFER_ROWS if staged else BUFFER_ROWS) // BI
    D2 = D // 2
    qk_scale = float(softmax_scale) * _LOG2E
    bf16, f32, i64 = "bfloat16", "float32", "int64"
    n_tok, s1, s2, k1, k2 = T.dynamic("n_tok, s1, s2, k1, k2")
    row_threads = 8  # producer threads per gathered row (each moves 2 x 4 x 16 B of it)
    rows_per_pass = 128 // row_threads
    passes = BI // rows_per_pass
    chunks = D2 // (8 * row_threads)  # 16-byte copies per thread per row half
    if not two_sources:
        fmt2 = fmt1
    if fmt1 not in (FMT_BF16, *_FORMATS) or fmt2 not in (FMT_BF16, *_FORMATS):
        raise ValueError(f"build_kernel: formats {fmt1}, {fmt2}; expected FMT_BF16, FMT_MXFP8 or FMT_NVFP4")
    # record rows are decoded by the producer (st.shared); bf16 rows keep their cp.async copies
    records = fmt1 != FMT_BF16 or (two_sources and fmt2 != FMT_BF16)
    copies = fmt1 == FMT_BF16 or (two_sources and fmt2 == FMT_BF16)
    if records and (D != HEAD_DIM or row_threads * 8 * chunks * 2 != D):
        raise ValueError(f"build_kernel: record sources need D == {HEAD_DIM}, found {D}")
    if staged and (copies or BI != STAGED_BLOCK_ROWS):
        raise ValueError(
            f"build_kernel: staged needs record sources only and {STAGED_BLOCK_ROWS}-row tiles, found formats "
            f"{fmt1}, {fmt2} and {BI} rows"
        )
    # one slot row holds the widest record of the kernel's formats (528 and 288 are multiples of 16: cp.async rows)
    stage_bytes = max(_FORMATS[f].record_bytes(D) for f in (fmt1, fmt2) if f != FMT_BF16) if records else 16
    lookahead = STAGE_SLOTS - 1
    row_width = {f: (D, bf16) if f == FMT_BF16 else (_FORMATS[f].record_bytes(D), "uint8") for f in (fmt1, fmt2)}
    # 32-row tiles (four buffers, whose addresses also take producer registers): one pass at a time, as two
    # spilled 28 bytes in ptxas
    group = min(_RECORD_PASSES_IN_FLIGHT, passes) if n_buf <= 2 else 1
    load_groups = [list(range(g, min(g + group, passes))) for g in range(0, passes, group)]

    # The macros below are expanded in place once per buffer, so every buffer index is static in the generated
    # code; `v` carries the kernel's buffers and thread values (a namespace built inside the kernel).
    def each_buffer(step, v, g):
        """Expands `step` once per buffer (plain Python: the buffer lists are indexed statically)."""
        for b in range(n_buf):
            step(v, v.ready[b], v.ok[b], v.k_l[b], v.k_r[b], v.free[b], g, n_buf * g + b)

    @T.macro
    def score_tile(v, ready, ok, k_l, k_r, free, p, j):
        T.barrier_wait(ready, p & 1)
        # The tile's rows were written through the generic proxy (cp.async or the record decode's st.shared) and
        # wgmma reads them through the async proxy. TileLang's own fence covers only the first buffer here.
        T.fence_proxy_async()
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
        T.fence_proxy_async()  # the tile's rows were written through the generic proxy; wgmma reads them
        for h, d in T.Parallel(H, D2):
            v.acc_r[h, d] = v.acc_r[h, d] * v.alpha_sh[h]
        T.gemm(v.p_sh, k_r, v.acc_r)
        T.barrier_arrive(free)
        if j < v.last:
            T.barrier_arrive(v.p_free)

    @T.macro
    def row_sources(v, j, r, x1=None, x2=None):
        """(x1, in1, x2, in2) of this thread's row in pass r of tile j: its index in each list (clamped loads, or
        the values given, loaded earlier) and whether that index is a valid row of its source (x2 / in2 None for
        one source)."""
        col = j * BI + r * rows_per_pass + v.lane // row_threads
        if x1 is None:
            x1 = v.Idx[v.bx, T.min(col, k1 - 1)]
        in1 = col < k1 and x1 >= 0 and x1 < T.cast(s1, i64)
        if not two_sources:
            return x1, in1, None, None
        if x2 is None:
            x2 = v.Idx2[v.bx, T.max(T.min(col - k1, k2 - 1), 0)]
        return x1, in1, x2, col >= k1 and col < k1 + k2 and x2 >= 0 and x2 < T.cast(s2, i64)

    @T.macro
    def load_stage_indices(v, t):
        """Issues the (clamped) index load of each of tile t's rows into nx; nothing uses them before the next tile
        step, so their latency hides behind that step's decode instead of stalling the copies."""
        for r in T.unroll(passes):
            col = t * BI + r * rows_per_pass + v.lane // row_threads
            if two_sources:  # one index per row: the list its column falls in (one register pair, not two)
                v.nx[r] = T.if_then_else(
                    col < k1, v.Idx[v.bx, T.min(col, k1 - 1)], v.Idx2[v.bx, T.max(T.min(col - k1, k2 - 1), 0)]
                )
            else:
                v.nx[r] = v.Idx[v.bx, T.min(col, k1 - 1)]

    @T.macro
    def load_indices(v, j):
        # The tile's indices first: unconditional (clamped) loads that are all in flight together and overlap the
        # wait for the buffer; a dependent index load before each row's copies would serialise their latencies.
        for r in T.unroll(passes):
            x1, in1, x2, in2 = row_sources(v, j, r)
            if two_sources:
                v.idx[r] = T.if_then_else(in1, x1, T.if_then_else(in2, x2, T.int64(0)))
                v.src[r] = T.if_then_else(in1, 1, T.if_then_else(in2, 2, 0))
            else:
                v.idx[r] = T.if_then_else(in1, x1, T.int64(0))
                v.src[r] = T.if_then_else(in1, 1, 0)

    @T.macro
    def load_rows(v, j):
        # load_indices for the record producer, whose registers are scarce: one int32 per row, the row of kv
        # (>= 0), none (-1) or the row x of kv2 as -2 - x. Row counts fit int32 (the kernel's sizes are int32).
        for r in T.unroll(passes):
            x1, in1, x2, in2 = row_sources(v, j, r)
            if two_sources:
                v.rid[r] = T.if_then_else(in1, T.cast(x1, "int32"), T.if_then_else(in2, -2 - T.cast(x2, "int32"), -1))
            else:
                v.rid[r] = T.if_then_else(in1, T.cast(x1, "int32"), -1)

    @T.macro
    def gather_tile(v, ready, ok, k_l, k_r, free, p, j):
        load_indices(v, j)
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

    # Python lists: a loop over them is expanded while the kernel is built (`range` would become a TIR loop), so
    # every register word index below is a constant and the words stay in registers.
    row_chunks = [(k // chunks, k % chunks) for k in range(2 * chunks)]  # this thread's chunks: (half, u)

    @T.macro
    def load_words(v, X, x, col, live, n, k):
        """n words into w[k:k + n] from X[x, col:...] where `live` (one vector load)."""
        T.call_extern(
            "handle", f"dk_ldg{32 * n}", T.access_ptr(v.w[k], "rw", n), T.access_ptr(X[x, col], "r", 4 * n), live
        )

    def stage_addr(v, stage_row, col):
        """Shared address of byte col of stage row stage_row (v.sbase: the stage's address, set once)."""
        return v.sbase[0] + T.cast(stage_row * stage_bytes + col, "uint32")

    def srid_addr(v, t, r):
        """Shared address of this thread's row id of pass r of tile t (one int32 per thread, slot and pass)."""
        return v.sbase[1] + T.cast(4 * ((t % STAGE_SLOTS) * 128 * passes + r * 128 + v.lane), "uint32")

    def record_words(v, fmt, w0):
        """This thread's loads of one record row: (byte offset in the row, words, first word w0 + ...) per load, namely
        per chunk its code bytes (MXFP8 8, NVFP4 4), then the row's scale bytes (MXFP8 16, NVFP4 32)."""
        if fmt == FMT_MXFP8:
            codes = [(half * D2 + u * 64 + v.c0, 2, w0 + 2 * k) for k, (half, u) in enumerate(row_chunks)]
            return [*codes, (D, 4, w0 + 16)]
        codes = [((half * D2 + u * 64) // 2 + v.c0 // 2, 1, w0 + k) for k, (half, u) in enumerate(row_chunks)]
        return [*codes, (D // 2, 4, w0 + 8), (D // 2 + 16, 4, w0 + 12)]

    @T.macro
    def load_record(v, X, fmt, x, live, w0):
        """Issues one row's loads (where `live`) into words w0.. of this thread's registers, no dependent use yet."""
        for col, n, k in record_words(v, fmt, w0):
            load_words(v, X, x, col, live, n, k)

    @T.macro
    def load_staged_record(v, fmt, stage_row, w0):
        """load_record from a staged row in shared memory (no predicate: the caller branches on the row's source)."""
        for col, n, k in record_words(v, fmt, w0):
            T.call_extern("handle", f"dk_lds{32 * n}", T.access_ptr(v.w[k], "rw", n), stage_addr(v, stage_row, col))

    @T.macro
    def store_chunk(v, fmt, X, x, k_half, row, k, half, u, w0):
        """Writes the row's 8 columns half * D2 + u * 64 + c0.. (this thread's chunk k) into k_half[row, ...]."""
        cb = half * D2 + u * 64  # static; c0 < 64 adds the thread's offset within the 64 columns
        if fmt == FMT_BF16:
            T.ptx_cp_async(T.access_ptr(k_half[row, u * 64 + v.c0], "w", 8), T.access_ptr(X[x, cb + v.c0], "r", 8), 8)
        elif fmt == FMT_MXFP8:  # scale byte (col // 32) of 16: word cb // 128, byte (cb % 128) // 32 + c0 // 32
            scale = v.w[w0 + 16 + cb // 128] >> T.cast(8 * ((cb % 128) // 32) + 8 * (v.c0 // 32), "uint32")
            T.call_extern(
                "handle", "dk_st_mxfp8", T.access_ptr(k_half[row, u * 64 + v.c0], "w", 8), v.w[w0 + 2 * k],
                v.w[w0 + 2 * k + 1], scale,
            )  # fmt: skip
        else:  # scale byte (col // 16) of 32: word cb // 64, byte c0 // 16
            scale = v.w[w0 + 8 + cb // 64] >> T.cast(8 * (v.c0 // 16), "uint32")
            T.call_extern("handle", "dk_st_nvfp4", T.access_ptr(k_half[row, u * 64 + v.c0], "w", 8), v.w[w0 + k], scale)

    @T.macro
    def store_record(v, fmt, X, x, k_l, k_r, row, w0):
        for k, (half, u) in enumerate(row_chunks):
            store_chunk(v, fmt, X, x, k_r if half else k_l, row, k, half, u, w0)

    @T.macro
    def gather_records(v, ready, ok, k_l, k_r, free, p, j):
        # Rows of record sources are loaded into registers (group by group: each group's loads are all issued
        # before any is decoded) and decoded into the tile; rows of a bf16 source keep their cp.async copies.
        # The first group's loads only fill registers, so they are issued before the wait for the buffer.
        load_rows(v, j)
        for g, rs in enumerate(load_groups):
            for i, r in enumerate(rs):
                if fmt1 != FMT_BF16:
                    load_record(v, v.KV, fmt1, T.cast(v.rid[r], i64), v.rid[r] >= 0, i * _RECORD_WORDS)
                if two_sources and fmt2 != FMT_BF16:
                    load_record(v, v.KV2, fmt2, T.cast(-2 - v.rid[r], i64), v.rid[r] <= -2, i * _RECORD_WORDS)
            if g == 0:
                T.barrier_wait(free, (p & 1) ^ 1)
            for i, r in enumerate(rs):
                row = r * rows_per_pass + v.lane // row_threads
                ok[row] = v.rid[r] != -1
                if v.rid[r] >= 0:
                    store_record(v, fmt1, v.KV, T.cast(v.rid[r], i64), k_l, k_r, row, i * _RECORD_WORDS)
                elif two_sources and v.rid[r] <= -2:
                    store_record(v, fmt2, v.KV2, T.cast(-2 - v.rid[r], i64), k_l, k_r, row, i * _RECORD_WORDS)
                else:  # explicit zeros: the buffer may hold anything, NaN patterns included
                    for half, u in row_chunks:
                        k_half = k_r if half else k_l
                        T.call_extern("handle", "dk_st_zero", T.access_ptr(k_half[row, u * 64 + v.c0], "w", 8))
        # The decode's stores are generic-proxy writes that wgmma reads through the async proxy: the writer's proxy
        # fence, then the arrive (a release). One plain arrival per thread unless copies are also tracked.
        T.fence_proxy_async()
        T.barrier_arrive(ready)
        if copies:
            T.cp_async_barrier_noinc(ready)

    @T.macro
    def stage_copies(v, X, fmt, x, stage_row, t8):
        """This thread's 16-byte cp.async chunks (lane % 8 + 8 i) of record row X[x] into stage row stage_row."""
        n16 = _FORMATS[fmt].record_bytes(D) // 16
        for i in T.unroll(n16 // row_threads):  # chunks below the last full round: all 8 lanes
            c = t8 + row_threads * i
            T.call_extern("handle", "dk_cp16", stage_addr(v, stage_row, c * 16), T.access_ptr(X[x, c * 16], "r", 16))
        if n16 % row_threads:  # the tail (MXFP8: chunk 32, the scales; NVFP4: chunks 16-17)
            c = t8 + row_threads * (n16 // row_threads)
            if t8 < n16 % row_threads:
                T.call_extern("handle", "dk_cp16", stage_addr(v, stage_row, c * 16), T.access_ptr(X[x, c * 16], "r", 16))

    @T.macro
    def issue_stage(v, t):
        """cp.async of tile t's raw record rows into slot t % STAGE_SLOTS and their row ids (load_rows' encoding)
        into this thread's entries of srid, from the indices load_stage_indices(v, t) left in nx (a row's one index
        is checked against the list its column falls in, as row_sources does): this thread copies 16-byte chunks
        lane % 8 + 8 i of each of its rows; rows past the lists get -1 and no copy. Committed by the caller as one
        group."""
        slot_row = (t % STAGE_SLOTS) * BI
        t8 = v.lane % row_threads
        for r in T.unroll(passes):
            row = r * rows_per_pass + v.lane // row_threads
            x1, in1, x2, in2 = row_sources(v, t, r, v.nx[r], v.nx[r] if two_sources else None)
            if two_sources:
                v.rid[r] = T.if_then_else(in1, T.cast(x1, "int32"), T.if_then_else(in2, -2 - T.cast(x2, "int32"), -1))
            else:
                v.rid[r] = T.if_then_else(in1, T.cast(x1, "int32"), -1)
            rid = v.rid[r]
            T.call_extern("handle", "dk_st_s32", srid_addr(v, t, r), rid)  # this thread's own entry
            # each source through a macro argument: a buffer bound to a Python name in the macro body (a loop over
            # (KV, KV2)) is renamed after it in the kernel's parameters, and two parameters of one name break the
            # packed-call ABI check (found on the H200: "input X shape[1] violates packed ABI constraint")
            if rid >= 0:
                stage_copies(v, v.KV, fmt1, T.cast(rid, i64), slot_row + row, t8)
            if two_sources:
                if rid <= -2:
                    stage_copies(v, v.KV2, fmt2, T.cast(-2 - rid, i64), slot_row + row, t8)

    @T.macro
    def gather_staged(v, ready, ok, k_l, k_r, free, p, j):
        # Slot (j + lookahead) % STAGE_SLOTS is the one tile j - 1 was decoded from: every lane of this warp must be
        # past that decode (a row's eight lanes read each other's chunks) before the new copies overwrite it.
        T.sync_warp()
        issue_stage(v, j + lookahead)
        load_stage_indices(v, j + lookahead + 1)
        T.call_extern("handle", "dk_cp_async_commit")
        T.call_extern("handle", f"dk_cp_async_wait<{lookahead}>")  # this thread's copies of tile j have landed ...
        T.sync_warp()  # ... and, past this, those of the other lanes of its rows (all in this warp)
        slot_row = (j % STAGE_SLOTS) * BI
        okb = T.call_extern("uint32", "dk_smem", T.access_ptr(ok[0], "r", 1))
        # A row's words into registers first, then its decodes: its loads are in flight together and the decodes of
        # its chunks interleave (a load placed after a decode's shared store would wait for that whole decode, one
        # chunk at a time). Loads read the stage slot only, so the first row's go before the wait for the tile.
        # One row at a time: the words of two rows and the producer's addresses spill at 96 registers.
        for r in T.serial(passes):  # not unrolled: one copy of the decodes (instruction cache)
            row = r * rows_per_pass + v.lane // row_threads
            v.rid[0] = T.call_extern("int32", "dk_ld_s32", srid_addr(v, j, r))
            rid = v.rid[0]
            if rid >= 0:
                load_staged_record(v, fmt1, slot_row + row, 0)
            elif two_sources and rid <= -2:
                load_staged_record(v, fmt2, slot_row + row, 0)
            if r == 0:
                T.barrier_wait(free, (p & 1) ^ 1)
            T.call_extern("handle", "dk_st_s8", okb + T.cast(row, "uint32"), T.cast(rid != -1, "int32"))
            if rid >= 0:
                store_record(v, fmt1, None, None, k_l, k_r, row, 0)
            elif two_sources and rid <= -2:
                store_record(v, fmt2, None, None, k_l, k_r, row, 0)
            else:
                for half, u in row_chunks:
                    k_half = k_r if half else k_l
                    T.call_extern("handle", "dk_st_zero", T.access_ptr(k_half[row, u * 64 + v.c0], "w", 8))
        T.fence_proxy_async()
        T.barrier_arrive(ready)

    prelude = (_DECODE_CUDA + (_DECODE_STAGED_CUDA if staged else "")) if records else None

    @T.prim_func
    def kernel(
        Q: T.Tensor([n_tok, H, D], bf16),
        KV: T.Tensor([s1, row_width[fmt1][0]], row_width[fmt1][1]),
        Idx: T.Tensor([n_tok, k1], i64),
        KV2: T.Tensor([s2, row_width[fmt2][0]], row_width[fmt2][1]),
        Idx2: T.Tensor([n_tok, k2], i64),
        Sink: T.Tensor([H], f32),
        Out: T.Tensor([n_tok, H, D], bf16),
    ):
        with T.Kernel(n_tok, threads=384, prelude=prelude) as bx:
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
            rid = T.alloc_local([passes], "int32")
            # record words in registers: the loads' passes in flight (register producer), one row (staged)
            w = T.alloc_local([(1 if staged else group) * _RECORD_WORDS if records else 1], "uint32")
            stage = T.alloc_shared([STAGE_SLOTS * BI, stage_bytes], "uint8") if staged else None
            # the producer threads' row ids per slot, one entry per thread (written and read by that thread only)
            srid = T.alloc_shared([STAGE_SLOTS * passes * 128], "int32") if staged else None
            nx = T.alloc_local([passes], i64) if staged else None
            sbase = T.alloc_local([2], "uint32") if staged else None  # shared addresses of stage and srid

            # per producer thread: two arrivals (plain + cp.async tracking) when copies are tracked, else one
            ready = [T.alloc_barrier(arrive_count=256 if copies else 128) for _ in range(n_buf)]
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
                k_l=k_l, k_r=k_r, ok=ok, ready=ready, free=free, last=n_buf * n_groups - 1, rid=rid, w=w,
                stage=stage, srid=srid, nx=nx, sbase=sbase,
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
                T.set_max_nreg(_PRODUCER_REGS_RECORDS if records else _PRODUCER_REGS, 0)
                if staged:
                    sbase[0] = T.call_extern("uint32", "dk_smem", T.access_ptr(stage[0, 0], "r", 1))
                    sbase[1] = T.call_extern("uint32", "dk_smem", T.access_ptr(srid[0], "r", 1))
                    for t in range(lookahead):  # the first tiles' copies, one group each, before any decode
                        load_stage_indices(v, t)
                        issue_stage(v, t)
                        T.call_extern("handle", "dk_cp_async_commit")
                    load_stage_indices(v, lookahead)
                for g in T.serial(n_groups):
                    each_buffer(gather_staged if staged else gather_records if records else gather_tile, v, g)

    return kernel


def pass_configs(staged: bool = False) -> dict:
    """TileLang pass options of this kernel. The gathers' row indices are data: the safe-memory pass cannot prove
    them in bounds and would turn every cp.async into a guarded synchronous load, so it is off (the producer
    range-checks each index itself). TIR_USE_ASYNC_COPY is the setting every measurement ran with; the gathers
    issue their cp.async explicitly either way. staged: the buffer-initialisation check is off too, as the staged
    producer writes its stage slots and row ids through shared addresses (so that the sync pass adds no barriers for
    them), which the check cannot see: it warned at every compile that they are read before written. (Only there:
    the option also reorders the other variants' buffer assignment, which the GPU tests did not cover.)"""
    import tilelang

    configs = {
        tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
        tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
        tilelang.PassConfigKey.TIR_USE_ASYNC_COPY: True,
    }
    if staged:
        configs[tilelang.PassConfigKey.TL_DISABLE_BUFFER_INIT_CHECK] = True
    return configs


@functools.cache
def _compiled(heads: int, dim: int, softmax_scale: float, two_sources: bool, block_rows: int, fmt1: int, fmt2: int,
              staged: bool = False):
    import tilelang

    func = build_kernel(heads, dim, softmax_scale, two_sources, block_rows, fmt1, fmt2, staged)
    return tilelang.compile(
        func,
        out_idx=None,
        target="cuda",
        pass_configs=pass_configs(staged),
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
    kv_format: KVFormat | None = None,
    kv2_format: KVFormat | None = None,
    staged: bool = False,
) -> Tensor:
    """q [T, 64, 512] bf16; kv [S, 512] bf16; indices [T, K] int64 (-1 / out of range = none); attn_sink [64];
    kv2 [S2, 512] / indices2 [T, K2]: an optional second source -> [T, 64, 512] bf16. kv_format / kv2_format
    (MXFP8_E4M3, NVFP4_E2M1 or None): that source is uint8 records [S, fmt.record_bytes(512)] instead of bf16
    rows. Inputs are validated by the package dispatcher, which also checks `supports` first. block_rows (32 or
    64): rows per gathered tile, with BUFFER_ROWS // block_rows tiles in flight (benchmark sweeps). staged: the
    staged record producer (build_kernel; record sources only, block_rows 32); the dispatcher's choice when every
    source is records."""
    if block_rows not in (32, 64):  # 16-row tiles compile (slowly) but were never run on a GPU
        raise ValueError(f"sparse_attn (tilelang): block_rows {block_rows}, expected 32 or 64")
    if staged and (block_rows != STAGED_BLOCK_ROWS or kv_format is None or (kv2 is not None and kv2_format is None)):
        raise ValueError(
            f"sparse_attn (tilelang): staged=True reads record sources only, in {STAGED_BLOCK_ROWS}-row tiles; found "
            f"block_rows {block_rows}, formats {kv_format and kv_format.name}, {kv2_format and kv2_format.name}"
        )
    t = q.shape[0]
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous, whatever q's strides
    if t == 0:
        return out
    fmt1, fmt2 = _format_code(kv_format), _format_code(kv2_format)
    two = kv2 is not None and kv2.shape[0] > 0 and indices2.shape[1] > 0
    if not two:  # placeholders the one-source kernel never reads (declared in kv's format)
        kv2, indices2, fmt2 = kv, indices, fmt1
    kernel = _compiled(q.shape[1], q.shape[2], float(softmax_scale), two, block_rows, fmt1, fmt2, staged)
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
