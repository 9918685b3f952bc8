"""What one cache family costs; shared by the model (which derives it) and the torch-free cache manager."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, kw_only=True)
class CacheFamily:
    """One kind of cached state.

    `kind == "paged"`: grows with the sequence; `bytes_per_token` is summed over all layers that own it and
    already divided by the compression ratio. `kind == "slot"`: fixed size per running sequence
    (`bytes_per_slot`, summed over layers).
    """

    name: str
    kind: Literal["paged", "slot"]
    num_layers: int
    bytes_per_token: float = 0.0
    bytes_per_slot: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("paged", "slot"):
            raise ValueError(f"CacheFamily {self.name!r}: kind must be 'paged' or 'slot', got {self.kind!r}")
        if self.bytes_per_token < 0 or self.bytes_per_slot < 0:
            raise ValueError(f"CacheFamily {self.name!r}: sizes must be >= 0")
