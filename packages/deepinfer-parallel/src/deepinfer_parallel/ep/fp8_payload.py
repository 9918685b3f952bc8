"""FP8 dispatch payloads: each activation row travels as e4m3 bytes plus one UE8M0 (power-of-two) scale byte per
`block` values, packed into one uint8 row so a single all-to-all carries both (docs/parallel.md, "FP8 payloads").

Encoding reuses deepinfer_kernels.quant (`quant_fp8_block` with a `(1, block)` block: per-row, per-block scales,
max |x| / scale <= 448). Both directions are pure tensor ops with no host read, so they can sit inside a CUDA graph.
"""

from __future__ import annotations

import torch
from deepinfer_kernels.quant import e8m0_to_float, quant_fp8_block
from torch import Tensor

from deepinfer_parallel.errors import ParallelConfigError

__all__ = ["FP8_BLOCKS", "decode_fp8_rows", "encode_fp8_rows", "fp8_row_bytes"]

FP8_BLOCKS: tuple[int, ...] = (32, 128)


def fp8_row_bytes(hidden: int, block: int) -> int:
    """Bytes of one encoded row: hidden e4m3 values + hidden / block scale bytes."""
    if block not in FP8_BLOCKS or hidden % block:
        raise ParallelConfigError(
            f"fp8 block: expected one of {FP8_BLOCKS} dividing hidden={hidden}, found {block!r}"
        )
    return hidden + hidden // block


def encode_fp8_rows(x: Tensor, block: int) -> Tensor:
    """`x [N, hidden]` float -> `[N, hidden + hidden/block] uint8` (e4m3 bytes, then UE8M0 scale bytes)."""
    n, hidden = x.shape
    fp8_row_bytes(hidden, block)
    q, scale = quant_fp8_block(x, block=(1, block), scale_fmt=None)  # scale [N, hidden/block] fp32, powers of two
    # The biased exponent field of a float32 power of two is its UE8M0 byte (no host check, unlike float_to_e8m0).
    scale_bytes = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return torch.cat([q.view(torch.uint8), scale_bytes], dim=1)


def decode_fp8_rows(payload: Tensor, hidden: int, block: int, dtype: torch.dtype) -> Tensor:
    """Inverse of `encode_fp8_rows`: `[N, hidden + hidden/block] uint8` -> `[N, hidden]` in `dtype`."""
    q = payload[:, :hidden].contiguous().view(torch.float8_e4m3fn).to(torch.float32)
    scale = e8m0_to_float(payload[:, hidden:].contiguous())
    return (q.view(q.shape[0], hidden // block, block) * scale[:, :, None]).view(q.shape[0], hidden).to(dtype)
