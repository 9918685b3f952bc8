"""Pure-torch reference of the V4.1 Engram gate and injection (docs/model.md §C.6), fp32 math.

r: [T, n, d] hc streams; keys: [T, n, d] per-stream keys; val: [T, d] the value; q_weight / k_weight: [n, d].
"""

from __future__ import annotations

import torch
from torch import Tensor

# Smallest |g| before the square root: sqrt(1e-6) = 1e-3 is the gate's smallest distance from 0.5.
GATE_CLAMP = 1e-6


def engram_gate(r: Tensor, key: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
    """Per-stream gate [T, n] float32.

    ``g_i = (Σ_c r_i[c] q_i[c] k_i[c] key_i[c]) · rsqrt(mean(r_i²)+ε) · rsqrt(mean(key_i²)+ε) / sqrt(d)``;
    returns ``sigmoid(copysign(sqrt(max(|g|, 1e-6)), g))``. copysign, as DeepSeek's gate kernel
    (docs/fidelity.md §4): g = +0 gives sigmoid(+1e-3) and g = -0 sigmoid(-1e-3), never the 0.5 a ``sign(g)``
    product would give.
    """
    rf, kf = r.float(), key.float()
    d = rf.shape[-1]
    dot = (rf * q_weight.float() * k_weight.float() * kf).sum(-1)
    g = dot * torch.rsqrt(rf.pow(2).mean(-1) + eps) * torch.rsqrt(kf.pow(2).mean(-1) + eps) / d**0.5
    return torch.sigmoid(torch.copysign(torch.sqrt(torch.clamp(g.abs(), min=GATE_CLAMP)), g))


def engram_inject(
    r: Tensor, keys: Tensor, val: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float,
    image_mask: Tensor | None = None,
) -> Tensor:
    """``R_i + gate_i · val`` [T, n, d] in r's dtype; image_mask [T] bool: gate 0 there (streams unchanged)."""
    gate = engram_gate(r, keys, q_weight, k_weight, eps)
    if image_mask is not None:
        gate = gate.masked_fill(image_mask[:, None], 0.0)
    return (r.float() + gate[..., None] * val.float()[:, None, :]).to(r.dtype)


def hash_rows(
    token_ids: Tensor, prev: Tensor, cid_table: Tensor, multipliers: Tensor, primes: Tensor, offsets: Tensor,
    pad_cid: int,
) -> Tensor:
    """Engram n-gram row ids ``[T, L, K*H] int64`` (docs/model.md §C.6), integer ops only.

    token_ids [T] int64; prev [T, K] int64: column s-1 the id at position p-s (-1: no such position);
    cid_table [C] int64: compressed id of id + 1 (entry 0 for id -1; negative = DEAD); multipliers [L, K+1];
    primes / offsets [L, K, H] (n-gram n = s+1 of head h). A DEAD entry blocks itself and every older shift
    (they hash as pad_cid); the hash of n = s+1 is the XOR of val_j * M_j over j <= s, reduced mod its prime.
    Every product stays below 2**63 and XOR keeps values non-negative (the multipliers' bound)."""
    t, k = prev.shape
    ids = torch.cat([token_ids[:, None], prev], dim=1)  # [T, K+1], s = 0..K
    cid = cid_table[(ids + 1).clamp_(0, cid_table.shape[0] - 1)]
    blocked = cid.cummin(dim=1).values < 0  # a running minimum stays negative from the first DEAD on
    val = cid.masked_fill(blocked, pad_cid)
    terms = val[:, None, :] * multipliers[None]  # [T, L, K+1]
    acc = [terms[:, :, 0]]
    for s in range(1, k + 1):
        acc.append(acc[-1] ^ terms[:, :, s])
    h = torch.stack(acc[1:], dim=2)  # [T, L, K]: the hash of n = s + 1
    out = h[..., None] % primes[None] + offsets[None]  # [T, L, K, H]
    return out.reshape(t, multipliers.shape[0], k * primes.shape[2])


def ring_step(
    ring: Tensor, token_ids: Tensor, positions: Tensor, seq_of_token: Tensor, seq_ctx: Tensor, seq_qlen: Tensor,
    seq_slot: Tensor, back: int, dump_slot: int,
) -> Tensor:
    """Each token's predecessors ``[T, back] int64`` from a token ring, then the step's ids written into it.

    ring ``[slots, R] int64`` (row = position mod R, -1 = never written), updated in place. Column s-1 is the id
    at position p-s of token t's sequence (p = positions[t]), -1 where p-s < 0 or the ring never got it.
    Positions inside the step come from ``token_ids`` (sequence-major rows: predecessor s of token t is row t-s),
    older ones from the ring row of the sequence's slot, read before this step's writes. The write keeps each
    sequence's last R tokens; the others go to ``dump_slot`` (every write has a fixed shape, no two kept writes
    hit the same cell). token_ids, positions, seq_of_token: [T] int64; seq_ctx (first new position), seq_qlen,
    seq_slot: [S] int64."""
    R = ring.shape[1]
    flat = ring.view(-1)
    s = torch.arange(1, back + 1, dtype=torch.int64, device=token_ids.device)  # [back]
    local = positions - seq_ctx[seq_of_token]  # [T] index of the token inside its sequence's step
    base = seq_slot[seq_of_token] * R  # [T] first ring cell of the token's slot
    q = positions[:, None] - s  # [T, back] predecessor positions
    rows = torch.arange(token_ids.shape[0], dtype=torch.int64, device=token_ids.device)[:, None] - s
    in_step = token_ids[rows.clamp_(min=0)]
    in_ring = flat[base[:, None] + q.remainder(R)]
    prev = torch.where(local[:, None] >= s, in_step, in_ring.masked_fill_(q < 0, -1))
    keep = local >= seq_qlen[seq_of_token] - R
    dst = torch.where(keep, base, dump_slot * R) + positions.remainder(R)
    flat.index_copy_(0, dst, token_ids)
    return prev


def lookup_rows(weight: Tensor, scale: Tensor, row_ids: Tensor, group: int, out_dtype: torch.dtype) -> Tensor:
    """FP8 table rows at row_ids, decoded (see deepinfer_kernels.engram.lookup_rows)."""
    from deepinfer_kernels.quant.reference import dequant_fp8_block

    flat = row_ids.reshape(-1)
    rows = dequant_fp8_block(weight[flat], scale[flat], (1, group))
    return rows.view(*row_ids.shape, -1).to(out_dtype)
