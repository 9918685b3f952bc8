"""Deployed KV numerics (``kv_cache_dtype="auto"``): the checkpoint's cache record formats as fake quantization.

Each point where DeepSeek's inference code writes a cache record (or quantizes an operand of the indexer) rounds
the values through that record's format here, so the model computes with exactly the values a paged cache of
those records would return (docs/fidelity.md §5). ``KVNumerics()`` (all None) is today's behaviour: no rounding.

V4.1 (DeepSeek's own inference code): sliding-window K/V after norm + RoPE in MXFP8 (e4m3, UE8M0 per 32) over all
head dims; compressed main KV in NVFP4 (e2m1, e4m3 scale per 16) over all head dims; indexer keys and queries in
MXFP4 (e2m1, UE8M0 per 32); index scores rounded to bf16. V4 (its reference model): window and compressed KV
with the non-RoPE dims in FP8 e4m3 + UE8M0 per 64 and the RoPE dims unrounded; its indexer (Hadamard + FP4) is
not modelled.

Rows shorter than a block (tiny test models) quantize as one partial block: zero padding does not change a
block's amax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepinfer_kernels.kv_records import fake_quant
from deepinfer_kernels.quant.kv_formats import MXFP4_E2M1, MXFP8_E4M3, NVFP4_E2M1, KVFormat
from torch import Tensor

__all__ = ["V4_FP8_NOPE", "KVNumerics", "kv_numerics"]

# V4 reference: act-quant of the non-RoPE KV dims, FP8 e4m3 with power-of-two scales per 64 channels.
V4_FP8_NOPE = KVFormat("fp8_e4m3_ue8m0_64", "e4m3", 64, "ue8m0", 1e-4)


def _round(x: Tensor, fmt: KVFormat, backend: str = "auto") -> Tensor:
    """fake_quant over the last dim of ``x [..., D]`` (a final partial block is zero-padded)."""
    d = x.shape[-1]
    pad = -d % fmt.block
    if pad:
        return fake_quant(F.pad(x, (0, pad)), fmt, backend=backend)[..., :d]
    return fake_quant(x, fmt, backend=backend)


@dataclass(frozen=True)
class KVNumerics:
    """Which record format each KV write / indexer operand goes through (None: kept as computed).

    ``rope_dims``: trailing dims left unrounded (V4's window/compressed records keep RoPE dims in bf16).
    """

    window: KVFormat | None = None
    compressed: KVFormat | None = None
    index: KVFormat | None = None
    bf16_index_scores: bool = False
    rope_dims: int = 0

    @property
    def enabled(self) -> bool:
        return self.window is not None or self.compressed is not None or self.index is not None

    def _kv(self, x: Tensor, fmt: KVFormat | None, backend: str) -> Tensor:
        if fmt is None:
            return x
        if self.rope_dims:
            nope = x.shape[-1] - self.rope_dims
            return torch.cat([_round(x[..., :nope], fmt, backend), x[..., nope:]], dim=-1)
        return _round(x, fmt, backend)

    # backend: the kernel backend of the rounding (deepinfer_kernels.kv_records.fake_quant), the model's own
    def window_kv(self, kv: Tensor, *, backend: str = "auto") -> Tensor:
        """Sliding-window K=V ``[T, Dh]`` after kv_norm and RoPE, as the window cache stores it."""
        return self._kv(kv, self.window, backend)

    def compressed_kv(self, kv: Tensor, *, backend: str = "auto") -> Tensor:
        """Compressed main-KV entries ``[E, Dh]`` after RoPE, as the compressed cache stores them."""
        return self._kv(kv, self.compressed, backend)

    def index_operand(self, x: Tensor, *, backend: str = "auto") -> Tensor:
        """Indexer keys ``[E, Di]`` / queries ``[T, H, Di]`` after RoPE (each head row quantized alone)."""
        return x if self.index is None else _round(x, self.index, backend)

    def index_scores(self, scores: Tensor) -> Tensor:
        """Index scores ``[T, E]`` as the indexer kernel returns them (bf16), back in float32."""
        return scores.to(torch.bfloat16).float() if self.bf16_index_scores else scores


def kv_numerics(args: object, deployed: bool, *, cache_records: bool = False) -> KVNumerics:
    """The checkpoint's deployment formats (``deployed``) or none (today's behaviour).

    ``cache_records``: the cache itself stores the window and compressed-entry records (``ModelCache`` with
    ``kv_cache_dtype="auto"``) and hands back decoded records, so those two are not rounded here again (NVFP4
    rounding is not idempotent: its e4m3 scale is recomputed from the already rounded block).
    """
    if not deployed:
        return KVNumerics()
    if args.arch == "v41":
        if cache_records:
            return KVNumerics(index=MXFP4_E2M1, bf16_index_scores=True)
        return KVNumerics(window=MXFP8_E4M3, compressed=NVFP4_E2M1, index=MXFP4_E2M1, bf16_index_scores=True)
    return KVNumerics(window=V4_FP8_NOPE, compressed=V4_FP8_NOPE, rope_dims=args.qk_rope_head_dim)
