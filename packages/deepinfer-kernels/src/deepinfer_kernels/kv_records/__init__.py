"""KV-cache records of the deployed V4.1 formats (MXFP8 / NVFP4 / MXFP4 rows, `deepinfer_kernels.quant.kv_formats`):
encoding rows into records and rounding values through a format (fake quantization).

Why a kernel: the torch reference of one encode is 20 to 40 small ops (block amax, the scale's bit arithmetic,
seven comparisons per FP4 code, packing, the record concatenation); a decode step with `kv_cache_dtype="auto"`
encodes its window rows, compressed entries and indexer keys and rounds its indexer queries in every layer, which
took the CPU proxy of a `layers-4` decode step from 131 to 347 kernel launches. The Triton kernel does each in one
launch and equals the reference bit for bit (the codes, the scale bytes and the rounded values).
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.kv_records import reference
from deepinfer_kernels.quant.kv_formats import KVFormat

__all__ = ["decode", "encode", "fake_quant"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _triton_ok(width: int, dtype: torch.dtype, fmt: KVFormat) -> tuple[bool, str]:
    """The kernel's inputs: rows of a power-of-two width >= the block (so a multiple of it), float values."""
    ok = dtype in _DTYPES and width >= fmt.block and width & (width - 1) == 0
    return ok, f"rows of {width} channels, {dtype}; needs a power-of-two width >= {fmt.block} and bf16/fp16/fp32"


def encode(x: Tensor, fmt: KVFormat, *, backend: str = "auto") -> Tensor:
    """x [rows, dim] float -> records [rows, fmt.record_bytes(dim)] uint8: the element codes (e4m3 bytes, or
    e2m1 pairs with the even column in the low nibble) followed by one scale byte per block."""
    if x.dim() != 2:
        raise ValueError(f"kv_records.encode: expected x [rows, dim], found shape {tuple(x.shape)}")
    ok, why = _triton_ok(x.shape[1], x.dtype, fmt)
    if resolve_backend("kv_records.encode", backend, x, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.kv_records import triton as triton_backend

        return triton_backend.encode(x, fmt)
    return reference.encode(x, fmt)


def decode(rec: Tensor, fmt: KVFormat, dtype: torch.dtype, *, backend: str = "auto") -> Tensor:
    """rec [..., record_bytes] uint8 records -> their values [..., dim] in dtype (value x scale in float32)."""
    if rec.dtype != torch.uint8 or rec.dim() < 1:
        raise ValueError(f"kv_records.decode: expected uint8 records [..., bytes], found {rec.dtype} {tuple(rec.shape)}")
    ok, why = _triton_ok(fmt.record_dim(rec.shape[-1]), dtype, fmt)
    if resolve_backend("kv_records.decode", backend, rec, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.kv_records import triton as triton_backend

        return triton_backend.decode(rec, fmt, dtype)
    return reference.decode(rec, fmt, dtype)


def fake_quant(x: Tensor, fmt: KVFormat, *, backend: str = "auto") -> Tensor:
    """x [..., dim] -> the values its records decode to, [..., dim] in x.dtype (each row quantized alone)."""
    ok, why = _triton_ok(x.shape[-1] if x.dim() else 0, x.dtype, fmt)
    if resolve_backend("kv_records.fake_quant", backend, x, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.kv_records import triton as triton_backend

        return triton_backend.fake_quant(x, fmt)
    return reference.fake_quant(x, fmt)
