"""V4.1 Engram (docs/model.md §C.6): the device token ring's step (`ring_step`: predecessors, then the writes),
n-gram row ids from token ids (`hash_rows`), the table rows they address decoded from FP8 (`lookup_rows`), the
gate and the injection into the hc streams (`engram_inject`): torch references; Triton kernels for each."""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_kernels._backend import resolve_backend
from deepinfer_kernels.engram import reference
from deepinfer_kernels.engram.reference import GATE_CLAMP, engram_gate

__all__ = ["GATE_CLAMP", "engram_gate", "engram_inject", "hash_rows", "lookup_rows", "ring_step"]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def engram_inject(
    r: Tensor, keys: Tensor, val: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
    image_mask: Tensor | None = None, *, backend: str = "auto",
) -> Tensor:
    """``R_i + gate_i · val``: r [T, n, d], keys [T, n, d], val [T, d], q_weight / k_weight [n, d], image_mask
    [T] bool (gate 0) or None -> [T, n, d] in r's dtype, fp32 math (reference.engram_gate).
    backend: "auto" | "torch" | "triton" (the kernel needs n a power of two and bf16/fp16/fp32 tensors)."""
    t, n, d = r.shape if r.dim() == 3 else (0, 0, 0)
    if r.dim() != 3 or keys.shape != r.shape or val.shape != (t, d) or q_weight.shape != (n, d) or (
        k_weight.shape != (n, d)
    ):
        raise ValueError(
            f"engram_inject: expected r [T, n, d], keys [T, n, d], val [T, d], q/k_weight [n, d]; found "
            f"{tuple(r.shape)}, {tuple(keys.shape)}, {tuple(val.shape)}, {tuple(q_weight.shape)}, "
            f"{tuple(k_weight.shape)}"
        )
    if image_mask is not None and image_mask.shape != (t,):
        raise ValueError(f"engram_inject: image_mask {tuple(image_mask.shape)}, expected ({t},)")
    ok = n >= 1 and (n & (n - 1)) == 0 and all(x.dtype in _DTYPES for x in (r, keys, val, q_weight, k_weight))
    why = f"n {n}, dtypes {r.dtype}/{keys.dtype}/{val.dtype}; needs n a power of two and bf16/fp16/fp32"
    tensors = (r, keys, val, q_weight, k_weight) + (() if image_mask is None else (image_mask,))
    if resolve_backend("engram_inject", backend, *tensors, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.engram import triton as triton_backend

        return triton_backend.engram_inject(r, keys, val, q_weight, k_weight, eps, image_mask)
    return reference.engram_inject(r, keys, val, q_weight, k_weight, eps, image_mask)


def hash_rows(
    token_ids: Tensor, prev: Tensor, cid_table: Tensor, multipliers: Tensor, primes: Tensor, offsets: Tensor,
    pad_cid: int, *, backend: str = "auto",
) -> Tensor:
    """Engram row ids [T, L, K*H] int64 of token_ids [T] with predecessors prev [T, K] (reference.hash_rows:
    shapes, the DEAD rule, the XOR hash). backend: "auto" | "torch" | "triton" (int64 tensors)."""
    t, k = prev.shape if prev.dim() == 2 else (-1, -1)
    if token_ids.shape != (t,) or multipliers.dim() != 2 or multipliers.shape[1] != k + 1 or (
        primes.dim() != 3 or primes.shape[:2] != (multipliers.shape[0], k) or offsets.shape != primes.shape
    ):
        raise ValueError(
            f"hash_rows: expected token_ids [T], prev [T, K], multipliers [L, K+1], primes / offsets [L, K, H]; found "
            f"{tuple(token_ids.shape)}, {tuple(prev.shape)}, {tuple(multipliers.shape)}, {tuple(primes.shape)}, "
            f"{tuple(offsets.shape)}"
        )
    tensors = (token_ids, prev, cid_table, multipliers, primes, offsets)
    ok = all(x.dtype == torch.int64 for x in tensors)
    why = "needs int64 tensors"
    if resolve_backend("engram_hash_rows", backend, *tensors, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.engram import triton as triton_backend

        return triton_backend.hash_rows(*tensors, pad_cid)
    return reference.hash_rows(*tensors, pad_cid)


def ring_step(
    ring: Tensor, token_ids: Tensor, positions: Tensor, seq_of_token: Tensor, seq_ctx: Tensor, seq_qlen: Tensor,
    seq_slot: Tensor, *, back: int, dump_slot: int, backend: str = "auto",
) -> Tensor:
    """Predecessors [T, back] int64 of the step's tokens from the token ring ring [slots, R] int64, then the step's
    ids written into it (in place; reference.ring_step). backend: "auto" | "torch" | "triton" (int64 tensors,
    a contiguous ring)."""
    seqs = (token_ids, positions, seq_of_token, seq_ctx, seq_qlen, seq_slot)
    if ring.dim() != 2 or any(x.dim() != 1 for x in seqs) or back < 0:
        raise ValueError(f"ring_step: expected ring [slots, R] and 1-D step tensors, back >= 0; found ring "
                         f"{tuple(ring.shape)}, back {back}")  # fmt: skip
    ok = ring.is_contiguous() and all(x.dtype == torch.int64 for x in (ring, *seqs))
    why = "needs int64 tensors and a contiguous ring"
    if resolve_backend("engram_ring_step", backend, ring, *seqs, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.engram import triton as triton_backend

        return triton_backend.ring_step(ring, *seqs, back, dump_slot)
    return reference.ring_step(ring, *seqs, back, dump_slot)


def lookup_rows(
    weight: Tensor, scale: Tensor, row_ids: Tensor, group: int, out_dtype: torch.dtype, *, backend: str = "auto"
) -> Tensor:
    """weight [N, D] float8_e4m3fn, scale [N, ceil(D / group)] UE8M0 (float8_e8m0fnu), row_ids [...] int64 in
    [0, N) -> [..., D] out_dtype: the looked-up rows decoded exactly (code x 2^scale in fp32), then cast once.
    backend: "auto" | "torch" | "triton" (D <= 16,384)."""
    if weight.dim() != 2 or scale.dim() != 2 or scale.shape != (weight.shape[0], -(-weight.shape[1] // group)):
        raise ValueError(f"lookup_rows: weight {tuple(weight.shape)}, scale {tuple(scale.shape)}, group {group}; "
                         "expected scale [N, ceil(D / group)]")  # fmt: skip
    d = weight.shape[1]
    ok = (weight.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and out_dtype in _DTYPES
          and 0 < d <= 16384 and group >= 1)  # fmt: skip
    why = f"weight {weight.dtype}, scale {scale.dtype}, D {d}, group {group}; needs e4m3 + e8m0, D <= 16384"
    if resolve_backend("lookup_rows", backend, weight, scale, row_ids, triton_ok=ok, why_not=why) == "triton":
        from deepinfer_kernels.engram import triton as triton_backend

        return triton_backend.lookup_rows(weight, scale, row_ids, group, out_dtype)
    return reference.lookup_rows(weight, scale, row_ids, group, out_dtype)
