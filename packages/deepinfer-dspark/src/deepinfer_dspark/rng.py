"""Counter-based uniforms: u = hash(seed, position, draw) -> [0, 1), a pure function of its key.

Every random decision of DSpark is keyed by the request's seed, the absolute token position it concerns and a
draw namespace, so results do not depend on batch composition, on how many drafts were verified, or on the order
requests are processed, and a run is reproducible from the seeds alone (docs/dspark.md "Randomness"):
  DRAW_DRAFT  (seed, p + 1 + j)  sampling draft d_{j+1} of the block anchored at position p;
  DRAW_ACCEPT (seed, p + 1 + j)  the acceptance test of d_{j+1};
  DRAW_FINAL  (seed, p)          the correction / bonus token of the round anchored at p (one per round; anchors
                                 strictly increase, so the key is never reused).
The hash is a cascade of a 32-bit integer finaliser over the key words, computed in int64 lanes with every
product < 2^63 (no reliance on wrap-around), identical on CPU and CUDA. 24 bits of it make the float32 uniform.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from deepinfer_dspark.errors import DSparkInputError

__all__ = ["DRAW_ACCEPT", "DRAW_DRAFT", "DRAW_FINAL", "counter_uniforms", "verify_counter_uniforms",
           "verify_counter_uniforms_host"]

DRAW_DRAFT = 0
DRAW_ACCEPT = 1
DRAW_FINAL = 2

_M32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2^27: x (< 2^32) * _MUL < 2^59, exact in int64
_GOLDEN = 0x9E3779B  # < 2^28, separates the key words before mixing


def _mix32(x: Tensor | np.ndarray) -> Tensor | np.ndarray:
    x = x & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    x = x ^ (x >> 16)
    x = (x * _MUL) & _M32
    return x ^ (x >> 16)


def counter_uniforms(seeds: Tensor, positions: Tensor, draw: int) -> Tensor:
    """Uniforms in [0, 1) for keys (seeds[b], positions[b, ...], draw).

    seeds: `[B] int64` per-request seeds (any int64; negative values are fine).
    positions: `[B]` or `[B, K] int64` absolute token positions (>= 0).
    draw: the namespace (DRAW_DRAFT / DRAW_ACCEPT / DRAW_FINAL or any int in [0, 2^31)).
    Returns float32 of positions' shape, multiples of 2^-24.
    """
    if seeds.dtype != torch.int64 or seeds.dim() != 1:
        raise DSparkInputError(f"seeds: expected a [B] int64 tensor, found {tuple(seeds.shape)} {seeds.dtype}")
    if positions.dtype != torch.int64 or positions.dim() not in (1, 2) or positions.shape[0] != seeds.shape[0]:
        raise DSparkInputError(
            f"positions: expected a [{seeds.shape[0]}] or [{seeds.shape[0]}, K] int64 tensor, found "
            f"{tuple(positions.shape)} {positions.dtype}"
        )
    if not 0 <= int(draw) < 2**31:
        raise DSparkInputError(f"draw: expected an int in [0, 2^31), found {draw!r}")
    return _uniforms(seeds, positions, int(draw) * _GOLDEN & _M32)


def _uniforms(seeds: Tensor, positions: Tensor, draw_word: int | Tensor) -> Tensor:
    """`counter_uniforms` with the draw's key word given: an int, or a tensor broadcast against positions (several
    namespaces in one pass, e.g. one per column; the same values as one call per namespace)."""
    s = seeds.to(positions.device)
    if positions.dim() == 2:
        s = s[:, None]
    h = _mix32(s + _GOLDEN)
    h = _mix32(h ^ ((s >> 32) & _M32))
    h = _mix32(h ^ (positions & _M32))
    h = _mix32(h ^ ((positions >> 32) & _M32) ^ draw_word)
    h = _mix32(h + _GOLDEN)
    return (h >> 8).to(torch.float32) * (1.0 / (1 << 24))


def verify_counter_uniforms(seeds: Tensor, anchor_positions: Tensor, width: int) -> Tensor:
    """The `[B, width + 1]` uniforms `rejection_accept` / `verify` consume for a round anchored at positions p:
    column j < width tests draft d_{j+1} (key p + 1 + j, DRAW_ACCEPT); column width samples the correction or
    bonus token (key p, DRAW_FINAL)."""
    p = anchor_positions.to(torch.int64)
    # one pass over [B, width + 1] keys: columns j < width at p + 1 + j (DRAW_ACCEPT), the last at p (DRAW_FINAL);
    # the hash runs eagerly, ~70 launches per pass, so the two namespaces share it
    offsets = torch.arange(1, width + 2, dtype=torch.int64)
    offsets[width] = 0
    words = torch.full((width + 1,), DRAW_ACCEPT * _GOLDEN & _M32, dtype=torch.int64)
    words[width] = DRAW_FINAL * _GOLDEN & _M32
    device_cols = torch.stack([offsets, words]).to(p.device, non_blocking=True)
    if seeds.dtype != torch.int64 or seeds.dim() != 1 or p.dim() != 1 or p.shape[0] != seeds.shape[0]:
        raise DSparkInputError(f"seeds / anchor_positions: expected [B] int64 each, found {tuple(seeds.shape)} "
                               f"{seeds.dtype} / {tuple(p.shape)}")
    return _uniforms(seeds, p[:, None] + device_cols[0][None, :], device_cols[1][None, :])


def verify_counter_uniforms_host(seeds: np.ndarray, anchor_positions: np.ndarray, width: int) -> np.ndarray:
    """`verify_counter_uniforms` in NumPy on the host, the same values bit for bit (`[B, width + 1] float32`): the
    same int64 lane operations (wrap-around alike), and the float32 conversion of a 24-bit integer times 2^-24 is
    exact. For callers that hold the seeds and positions on the host (the engine): on the device the hash is about
    70 kernel launches per round, host-bound on the H200 at every batch size (docs/dspark.md "Verification")."""
    s = np.asarray(seeds, dtype=np.int64)
    p = np.asarray(anchor_positions, dtype=np.int64)
    if s.ndim != 1 or p.shape != s.shape:
        raise DSparkInputError(f"seeds / anchor_positions: expected [B] int64 each, found {s.shape} / {p.shape}")
    offsets = np.arange(1, width + 2, dtype=np.int64)
    offsets[width] = 0
    words = np.full(width + 1, DRAW_ACCEPT * _GOLDEN & _M32, dtype=np.int64)
    words[width] = DRAW_FINAL * _GOLDEN & _M32
    positions = p[:, None] + offsets[None, :]
    with np.errstate(over="ignore"):  # int64 lanes wrap as torch's do; only the low 32 bits are kept
        s = s[:, None]
        h = _mix32(s + _GOLDEN)
        h = _mix32(h ^ ((s >> 32) & _M32))
        h = _mix32(h ^ (positions & _M32))
        h = _mix32(h ^ ((positions >> 32) & _M32) ^ words[None, :])
        h = _mix32(h + _GOLDEN)
    return (h >> 8).astype(np.float32) * np.float32(1.0 / (1 << 24))
