"""Torch references of the record encoder and fake quantization (`deepinfer_kernels.quant.kv_formats` rules)."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels.quant import kv_formats
from deepinfer_kernels.quant.kv_formats import KVFormat

__all__ = ["decode", "encode", "fake_quant"]


def encode(x: Tensor, fmt: KVFormat) -> Tensor:
    """x [rows, dim] -> [rows, record_bytes] uint8: codes, then scale bytes."""
    codes, scales = kv_formats.quantize(x, fmt)
    return torch.cat([codes, scales], 1)


def decode(rec: Tensor, fmt: KVFormat, dtype: torch.dtype) -> Tensor:
    """rec [..., record_bytes] uint8 -> [..., dim] in dtype (kv_formats.decode_records)."""
    return kv_formats.decode_records(rec, fmt, dtype)


def fake_quant(x: Tensor, fmt: KVFormat) -> Tensor:
    """x [..., dim] -> dequantize(quantize(x)) in x.dtype."""
    return kv_formats.fake_quant(x, fmt)
