"""Triton two-stage greedy argmax vs torch.argmax (exact: the same index for every row).

Rows cover ties inside and across chunks (the lowest index must win), a maximum in the last partial chunk, NaN
(first NaN wins, as torch.argmax), +Inf, all -Inf, and the `invalid` id for rows whose max is not finite.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.sampling import greedy_argmax, reference
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.sampling.triton") as (mod,):
        yield mod


def _rows(v: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(v)
    x = torch.randn(9, v, generator=g)
    x[0, [5, v // 2, v - 1]] = 50.0  # tie across chunks: index 5
    x[1, [v - 3, v - 1]] = 50.0  # tie in the last (partial) chunk
    x[2, 7] = float("nan")  # NaN after the max: the NaN wins
    x[2, 3] = 50.0
    x[3, [v - 2, 4]] = float("nan")  # two NaNs: the first
    x[4] = float("-inf")  # all -inf: index 0
    x[5, v // 3] = float("inf")
    x[6, :] = 1.0  # all equal: index 0
    x[7, :] = float("-inf")
    x[7, v - 1] = -1e30  # the only finite entry is the last one
    return x.to(dtype).to(device)


_V = [20, 100, 4096, 4097, 129280]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("v", _V)
def test_interpreter_equals_torch_argmax(interp, v, dtype):
    x = _rows(v, dtype)
    assert torch.equal(interp.greedy_argmax(x), x.argmax(dim=-1))
    want = reference.greedy_argmax(x, invalid=-1)
    assert torch.equal(interp.greedy_argmax(x, invalid=-1), want)
    assert want[[2, 3, 4, 5]].tolist() == [-1] * 4 and want[0] == 5 and want[7] == v - 1


def test_interpreter_strided_and_empty(interp):
    x = _rows(300, torch.float32)[:, ::2]  # last dim not contiguous: copied
    assert torch.equal(interp.greedy_argmax(x), x.argmax(dim=-1))
    assert interp.greedy_argmax(torch.zeros(0, 10)).shape == (0,)


def test_dispatcher(interp):
    x = _rows(5000, torch.float32)
    assert torch.equal(greedy_argmax(x, backend="triton"), x.argmax(dim=-1))
    x64 = x.double()  # no kernel for float64: the reference
    assert torch.equal(greedy_argmax(x64), x64.argmax(dim=-1))
    with pytest.raises(ValueError, match=r"greedy_argmax: logits must be \[N, V\]"):
        greedy_argmax(x[0])


@pytest.mark.gpu
@pytest.mark.parametrize("v", [129280, 4096, 17])
@pytest.mark.parametrize("n", [1, 8, 64])
def test_gpu_equals_torch_argmax(v, n):
    x = torch.randn(n, v, device="cuda")
    x[:, :: max(1, v // 7)] = x.max()  # ties across chunks
    assert torch.equal(greedy_argmax(x, backend="triton"), x.argmax(dim=-1))
    y = _rows(v, torch.float32, "cuda")
    assert torch.equal(greedy_argmax(y, backend="triton"), y.argmax(dim=-1))
    assert torch.equal(greedy_argmax(y, invalid=-1, backend="triton"), reference.greedy_argmax(y, invalid=-1))
