"""Triton record encoder / fake quantizer vs the torch reference (kv_records.reference), bit for bit.

The interpreter runs the kernel's own arithmetic (integer e4m3 rounding, correctly rounded divisions, the e2m1
midpoint search), so equality here is equality of the bytes the GPU writes. Inputs cover blocks of zeros and
negative zeros, values that land exactly on e2m1 midpoints and e4m3 ties after scaling, values saturating the
element range, scales clamped at the e4m3 maximum, tiny blocks raised to the amax floor, and a partial last
program.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.kv_records import decode, encode, fake_quant, reference
from deepinfer_kernels.quant.kv_formats import MXFP4_E2M1, MXFP8_E4M3, NVFP4_E2M1
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_FORMATS = [MXFP8_E4M3, NVFP4_E2M1, MXFP4_E2M1]


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.kv_records.triton") as (mod,):
        yield mod


def _rows(n: int, dim: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * torch.logspace(-3, 3, n).unsqueeze(1)
    blk = 16
    x[0] = 0.0
    x[1] = -0.0
    x[2, :blk] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2)  # e2m1 midpoints at scale 1
    x[2, blk:] = 1e-30  # floor-raised amax
    x[3] = torch.randint(-448, 449, (dim,), generator=g).float()  # on the e4m3 grid and between its points
    x[4] = 1e6 * torch.sign(torch.randn(dim, generator=g))  # NVFP4 scale clamped at 448
    x[5, ::2] = -x[5, 1::2]
    return x.to(dtype)


@pytest.mark.parametrize("fmt", _FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dim", [512, 128, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_encode_equals_reference_bytes(interp, fmt, dim, dtype):
    x = _rows(37, dim, seed=dim + len(fmt.name), dtype=dtype)
    got = interp.encode(x, fmt)
    want = reference.encode(x, fmt)
    assert got.dtype == torch.uint8 and got.shape == want.shape == (37, fmt.record_bytes(dim))
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{bad.shape[0]} bytes differ, first at {bad[:3].tolist()}"


@pytest.mark.parametrize("fmt", _FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fake_quant_equals_reference_values(interp, fmt, dtype):
    x = _rows(21, 128, seed=5, dtype=dtype).reshape(7, 3, 128)  # queries [T, H, D]: each head row alone
    got = interp.fake_quant(x, fmt)
    want = reference.fake_quant(x, fmt)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, want)


def test_rows_read_in_place_and_empty(interp):
    x = _rows(10, 256, seed=1, dtype=torch.float32)[:, :128]  # row stride 256
    assert torch.equal(interp.encode(x, MXFP8_E4M3), reference.encode(x, MXFP8_E4M3))
    assert interp.encode(x[:0], NVFP4_E2M1).shape == (0, NVFP4_E2M1.record_bytes(128))


def test_dispatcher(interp):
    x = _rows(6, 64, seed=2, dtype=torch.float32)
    assert torch.equal(encode(x, NVFP4_E2M1, backend="triton"), reference.encode(x, NVFP4_E2M1))
    assert torch.equal(fake_quant(x, MXFP4_E2M1, backend="triton"), reference.fake_quant(x, MXFP4_E2M1))
    odd = x[:, :48]  # not a power of two: the reference
    assert torch.equal(encode(odd, MXFP4_E2M1.__class__("w48", "e2m1", 16, "ue8m0", 1e-4)),
                       reference.encode(odd, MXFP4_E2M1.__class__("w48", "e2m1", 16, "ue8m0", 1e-4)))
    with pytest.raises(ValueError, match="expected x \\[rows, dim\\]"):
        encode(x.reshape(2, 3, 64), MXFP8_E4M3)


@pytest.mark.parametrize("fmt", _FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_decode_equals_reference_values(interp, fmt, dtype):
    rec = reference.encode(_rows(19, 128, seed=9, dtype=torch.float32), fmt)
    rec[7] = torch.randint(0, 256, (rec.shape[1],), generator=torch.Generator().manual_seed(4)).to(torch.uint8)
    rec[7, :fmt.code_bytes(128)] &= 0x77 if fmt.element == "e4m3" else 0xFF  # any codes but e4m3's NaN (0x7F)
    rec[7, fmt.code_bytes(128):] = torch.arange(100, 100 + 128 // fmt.block, dtype=torch.uint8)  # normal scales
    got = interp.decode(rec.reshape(1, 19, -1), fmt, dtype)
    want = reference.decode(rec.reshape(1, 19, -1), fmt, dtype)
    assert got.shape == want.shape == (1, 19, 128) and got.dtype == dtype
    assert torch.equal(got, want)
    assert torch.equal(decode(rec, fmt, dtype, backend="triton"), want.reshape(19, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", _FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("dim", [512, 128])
def test_gpu_equals_reference(fmt, dim):
    """The compiled kernel on the GPU: the same bytes and values as the torch reference on the CPU, and a CUDA
    graph replay of the encode on new rows (the decode step writes records inside its graph)."""
    x = _rows(301, dim, seed=dim, dtype=torch.bfloat16)
    xc = x.cuda()
    rec = encode(xc, fmt, backend="triton")
    assert torch.equal(rec.cpu(), reference.encode(x, fmt))
    assert torch.equal(decode(rec, fmt, torch.bfloat16, backend="triton").cpu(),
                       reference.decode(reference.encode(x, fmt), fmt, torch.bfloat16))
    q = xc.reshape(-1, 7, dim)[:43]
    assert torch.equal(fake_quant(q, fmt, backend="triton").cpu(), reference.fake_quant(q.cpu(), fmt))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = encode(xc, fmt, backend="triton")
    new = _rows(301, dim, seed=dim + 1, dtype=torch.bfloat16)
    xc.copy_(new)
    graph.replay()
    assert torch.equal(out.cpu(), reference.encode(new, fmt))
