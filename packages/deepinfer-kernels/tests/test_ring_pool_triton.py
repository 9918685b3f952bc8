"""Triton `ring_pool` (one launch: history gather, fresh rows, ring writes) vs the torch reference: bit-exact
copies, for disjoint reads and writes as the fixed-shape decode step has them; the dispatcher keeps the reference
when the caller cannot promise disjoint rows. Across dtypes (the model never mixes them here) the one fp32 -> bf16
cast is exact on the GPU; the CPU interpreter truncates instead of rounding, so there 1 bf16 ULP (rtol 2^-7)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.ring_pool import reference, ring_pool
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.ring_pool.triton") as (mod,):
        yield mod


def _case(n: int, h: int, t: int, m: int, row: tuple[int, ...], ring_dtype, fresh_dtype, seed: int, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    flat = torch.randn(n, *row, generator=g).to(ring_dtype)
    perm = torch.randperm(n, generator=g)
    hist, dst = perm[:h], perm[h : h + m]  # rows read and rows written: disjoint
    fresh = torch.randn(t, *row, generator=g).to(fresh_dtype)
    src = torch.randint(0, max(t, 1), (m,), generator=g)
    return [a.to(device) for a in (flat, hist, fresh, dst, src)]


CASES = [
    # (ring rows, history rows, fresh rows, writes, row shape, ring dtype, fresh dtype)
    (64, 31, 1, 1, (40,), torch.bfloat16, torch.bfloat16),  # a decode step's window pool (B = 1)
    (64, 24, 8, 8, (2, 24), torch.float32, torch.float32),  # a compressor state ring [.., 2, C]
    (50, 7, 3, 2, (1500,), torch.float32, torch.float32),  # a row wider than one block
    (30, 5, 4, 0, (8,), torch.float32, torch.bfloat16),  # no write, cast on read
    (30, 0, 4, 3, (8,), torch.bfloat16, torch.float32),  # no history: pool is fresh, cast on write
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"h{c[1]}t{c[2]}m{c[3]}w{c[4]}")
def test_interpreter_matches_reference(interp, case):
    n, h, t, m, row, rd, fd = case
    flat, hist, fresh, dst, src = _case(n, h, t, m, row, rd, fd, seed=n + h)
    flat_ref = flat.clone()
    w = (dst, src) if m else (None, None)
    want = reference.ring_pool(flat_ref, hist, fresh, *w)
    got = interp.ring_pool(flat, hist, fresh, *w)
    assert got.dtype == want.dtype
    if rd == fd:
        assert torch.equal(got, want) and torch.equal(flat, flat_ref)
    else:
        torch.testing.assert_close(got.float(), want.float(), atol=0, rtol=2.0**-7)
        torch.testing.assert_close(flat.float(), flat_ref.float(), atol=0, rtol=2.0**-7)


def test_dispatcher(interp):
    flat, hist, fresh, dst, src = _case(40, 9, 2, 2, (16,), torch.float32, torch.float32, seed=1)
    ref_flat = flat.clone()
    want = reference.ring_pool(ref_flat, hist, fresh, dst, src)
    assert torch.equal(ring_pool(flat, hist, fresh, dst, src, disjoint=True, backend="triton"), want)
    assert torch.equal(flat, ref_flat)
    with pytest.raises(ValueError, match="has no kernel"):  # overlapping reads and writes: no single launch
        ring_pool(flat, hist, fresh, dst, src, backend="triton")
    with pytest.raises(ValueError, match="go together"):
        ring_pool(flat, hist, fresh, dst, None)
    # overlapping rows: the reference reads the history before it writes
    over = flat.clone()
    got = ring_pool(over, hist, fresh, hist[:2], src, backend="torch")
    assert torch.equal(got[:9], flat[hist]) and torch.equal(over[hist[:2]], fresh[src])


@pytest.mark.gpu
@pytest.mark.parametrize("b", [1, 64])
def test_gpu_matches_reference(b):
    # V4.1 window pool: 127 history rows + 1 fresh row per sequence, head_dim 512 bf16; a ratio-2 state ring
    for h, row, rd, fd in ((127 * b, (512,), torch.bfloat16, torch.bfloat16), (b, (2, 512), torch.float32,
                           torch.float32), (3 * b, (64,), torch.bfloat16, torch.float32)):  # fmt: skip
        flat, hist, fresh, dst, src = _case(160 * b, h, b, b, row, rd, fd, seed=b, device="cuda")
        flat_ref = flat.clone()
        want = reference.ring_pool(flat_ref, hist, fresh, dst, src)
        got = ring_pool(flat, hist, fresh, dst, src, disjoint=True, backend="triton")
        assert torch.equal(got, want) and torch.equal(flat, flat_ref)
