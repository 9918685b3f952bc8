"""The epilogue shared by the Triton linear kernels: an output tile written directly, or, with split-K, as one fp32
partial of S whose last-arriving program sums them in a fixed order (deterministic) and resets the tile's arrival
counter (the scheme is described in `deepinfer_kernels.linear.triton`)."""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["write_tile"]


@triton.jit
def write_tile(acc, y_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, m_mask, n_mask, N, stride_ym, stride_split, pid_s,
                SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """acc [BLOCK_M, BLOCK_N] fp32 -> y; with SPLIT_K, this program's partial -> the workspace, and the last of the
    tile's programs to arrive sums the partials in split order 0..S-1, writes y and resets the tile's counter."""
    y_mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    if SPLIT_K:
        splits = tl.num_programs(2)
        tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
        part_ptrs = ws_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(part_ptrs + pid_s.to(tl.int64) * stride_split, acc, mask=y_mask)
        # every thread's partial is stored before the one release below publishes the tile
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel")
        if arrived == splits - 1:
            tot = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            # small tiles: four partials in flight per step (up to 64 splits would otherwise be 64 dependent L2
            # round trips), still added one by one in split order; a split past the end reads -0.0, the exact
            # identity of +. Large MMA tiles keep one at a time (4 more tiles of registers would spill).
            for i in range(0, splits, 4 if BLOCK_M * BLOCK_N <= 2048 else 1):
                # .cg: read at L2, where the other programs' stores are, never a stale L1 line
                p0 = tl.load(part_ptrs, mask=y_mask, other=0.0, cache_modifier=".cg")
                if BLOCK_M * BLOCK_N <= 2048:
                    m1 = y_mask & ((tl.zeros([1, 1], dtype=tl.int32) + i + 1) < splits)
                    p1 = tl.load(part_ptrs + stride_split, mask=m1, other=-0.0, cache_modifier=".cg")
                    m2 = y_mask & ((tl.zeros([1, 1], dtype=tl.int32) + i + 2) < splits)
                    p2 = tl.load(part_ptrs + 2 * stride_split, mask=m2, other=-0.0, cache_modifier=".cg")
                    m3 = y_mask & ((tl.zeros([1, 1], dtype=tl.int32) + i + 3) < splits)
                    p3 = tl.load(part_ptrs + 3 * stride_split, mask=m3, other=-0.0, cache_modifier=".cg")
                    tot = (((tot + p0) + p1) + p2) + p3
                    part_ptrs += 4 * stride_split
                else:
                    tot += p0
                    part_ptrs += stride_split
            tl.store(y_ptrs, tot.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
