"""Triton `pool_at_rows` (gather of each entry's token rows + softmax pooling + cast, one launch) vs the torch
reference. Tolerance: fp32 atol 1e-6 / rtol 1e-5 (the kernel's exp and sum order against torch's softmax);
bf16 out 1 ULP (rtol 2^-7: the fp32 values may straddle a rounding midpoint, and the CPU interpreter truncates)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.compressor import pool_at_rows, reference
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.compressor.triton") as (mod,):
        yield mod


def _case(p: int, m: int, k: int, c: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(p, 2, c, generator=g) * 3
    rows = torch.randint(0, p, (m, k), generator=g)
    return pool.to(device), rows.to(device)


@pytest.mark.parametrize("shape", [(9, 1, 2, 64), (40, 5, 2, 300), (12, 3, 4, 16), (5, 0, 2, 8)], ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_interpreter_matches_reference(interp, shape, dtype):
    pool, rows = _case(*shape, seed=sum(shape))
    got = interp.pool_at_rows(pool, rows, dtype)
    want = reference.pool_at_rows(pool, rows, dtype)
    assert got.dtype == dtype and got.shape == want.shape
    tol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-6, 2.0**-7)
    torch.testing.assert_close(got.float(), want.float(), atol=tol[0], rtol=tol[1])


def test_dispatcher(interp):
    pool, rows = _case(9, 4, 2, 32, seed=1)
    torch.testing.assert_close(pool_at_rows(pool, rows, torch.float32, backend="triton"),
                               reference.pool_at_rows(pool, rows, torch.float32), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="pool_at_rows"):
        pool_at_rows(pool[:, :1], rows, torch.float32)
    with pytest.raises(ValueError, match="has no kernel"):
        pool_at_rows(pool.double(), rows, torch.float32, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_gpu_matches_reference(m):
    # V4.1 ratio-2 kv source: head_dim 512, 2 tokens per entry
    pool, rows = _case(2 * m + 8, m, 2, 512, seed=m, device="cuda")
    for dtype, tol in ((torch.float32, (1e-6, 1e-5)), (torch.bfloat16, (1e-6, 2.0**-7))):
        got = pool_at_rows(pool, rows, dtype, backend="triton")
        torch.testing.assert_close(got.float(), reference.pool_at_rows(pool, rows, dtype).float(), atol=tol[0],
                                   rtol=tol[1])  # fmt: skip
