"""Routed experts of one layer stacked ``[E, ...]`` in their checkpoint format, with an exact per-expert decoder.

Formats: "dense" (float weights as given), "fp4" (e2m1 codes packed two per byte, low nibble = even column,
UE8M0 scale per 1 x 32), "fp4_chunked" (the same codes and scales in the chunked byte order the GPU kernels read
coalesced, `moe.fp4_layout`; same shapes and dtypes), "fp8" (e4m3 with block scales, V4-Flash-Base experts).
Indexing ``experts[e]`` decodes one expert to float32 ``(w1, w3, w2)`` (the torch reference dequantizes only the
experts a step uses).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from deepinfer_kernels.moe.fp4_layout import CHUNK, chunk_codes, chunk_scales, unchunk_codes, unchunk_scales
from deepinfer_kernels.quant.reference import dequant_fp4, dequant_fp8_block

__all__ = ["EXPERT_FORMATS", "StackedExperts"]

EXPERT_FORMATS = ("dense", "fp4", "fp4_chunked", "fp8")


@dataclass(frozen=True, eq=False)
class StackedExperts:
    """w1 / w3 ``[E, I, d]`` (fp4: ``[E, I, d/2] int8``), w2 ``[E, d, I]`` (fp4: ``[E, d, I/2]``); scales
    ``s1 / s3 [E, I, d/32]``, ``s2 [E, d, I/32]`` e8m0 for fp4 and fp4_chunked (fp8: ``[E, ceil(out/b0),
    ceil(in/b1)]``), None for dense. ``block``: the scale block (fp4 (1, 32)). fp4_chunked needs d and I
    multiples of 128 and contiguous tensors."""

    w1: Tensor
    w3: Tensor
    w2: Tensor
    s1: Tensor | None = None
    s3: Tensor | None = None
    s2: Tensor | None = None
    fmt: str = "dense"
    block: tuple[int, int] = (1, 32)

    def __post_init__(self) -> None:
        if self.fmt not in EXPERT_FORMATS:
            raise ValueError(f"StackedExperts: fmt {self.fmt!r}, expected one of {EXPERT_FORMATS}")
        if self.w1.dim() != 3 or self.w1.shape != self.w3.shape or self.w2.shape[0] != self.w1.shape[0]:
            raise ValueError(
                f"StackedExperts: w1 {tuple(self.w1.shape)}, w3 {tuple(self.w3.shape)}, w2 {tuple(self.w2.shape)}; "
                "expected w1 = w3 [E, I, d'] and w2 [E, d, I']"
            )
        if (self.fmt == "dense") != (self.s1 is None or self.s3 is None or self.s2 is None):
            raise ValueError(f"StackedExperts: fmt {self.fmt!r} needs scales exactly when quantized")
        if self.fmt == "fp4_chunked":
            if self.hidden % CHUNK or self.inter % CHUNK or self.block != (1, 32):
                raise ValueError(
                    f"StackedExperts: fp4_chunked with d {self.hidden}, I {self.inter}, block {self.block}; "
                    f"expected d and I multiples of {CHUNK} and block (1, 32) (keep fmt 'fp4' otherwise)"
                )

    def __len__(self) -> int:
        return self.w1.shape[0]

    @property
    def hidden(self) -> int:
        return self.w2.shape[1]

    @property
    def inter(self) -> int:
        return self.w1.shape[1]

    def chunked(self) -> StackedExperts:
        """fp4 -> fp4_chunked copies (the GPU layout; `moe.fp4_layout`); the engine repacks in place instead."""
        if self.fmt != "fp4":
            raise ValueError(f"StackedExperts.chunked: fmt {self.fmt!r}, expected 'fp4'")
        return StackedExperts(
            *(chunk_codes(w.contiguous()) for w in (self.w1, self.w3, self.w2)),
            *(chunk_scales(s.contiguous()) for s in (self.s1, self.s3, self.s2)),
            fmt="fp4_chunked", block=self.block,
        )  # fmt: skip

    def _decode(self, w: Tensor, s: Tensor | None) -> Tensor:
        if self.fmt == "dense":
            return w
        if self.fmt == "fp4":
            return dequant_fp4(w, s, block=self.block[1])
        if self.fmt == "fp4_chunked":
            return dequant_fp4(unchunk_codes(w), unchunk_scales(s), block=self.block[1])
        return dequant_fp8_block(w, s, self.block)

    def __getitem__(self, e: int) -> tuple[Tensor, Tensor, Tensor]:
        return (
            self._decode(self.w1[e], None if self.s1 is None else self.s1[e]),
            self._decode(self.w3[e], None if self.s3 is None else self.s3[e]),
            self._decode(self.w2[e], None if self.s2 is None else self.s2[e]),
        )
