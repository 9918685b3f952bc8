"""Engram row ids on the device (docs/engram_device_hashing.md): the same int64 values as
`EngramHasher.hash_batch` (engram_hash.py, numpy, the reference), from device tensors and in pure torch integer
ops: no host read, no data-dependent shape, so a CUDA graph can capture it and an asynchronous step can hash ids
that only exist on the device (placeholders resolved from the previous step's samples).

The caller hands each token's predecessors explicitly (``prev [T, max_ngram-1]``: the ids at positions p-1, p-2, ..
or -1 where the sequence has no such position); token_ring.py gathers them from the step's ids and the cache's
device token ring. Arithmetic is the reference's: ``val * M`` stays below 2**63 by the multipliers' bound
(engram_multipliers), XOR keeps values non-negative, so ``r % prime`` is the same floor remainder in numpy and torch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_engine.errors import InputError
from deepinfer_engine.model.engram_hash import DEAD, EngramHasher

__all__ = ["DeviceEngramHasher"]


class DeviceEngramHasher:
    """`EngramHasher`'s constants as tensors on one device, and its row-id rule over per-token predecessors."""

    def __init__(self, hasher: EngramHasher, device: torch.device | str) -> None:
        self.source = hasher
        self.device = torch.device(device)
        self.history_len = hasher.history_len
        self.n_heads = hasher.n_heads
        self.num_layers = len(hasher.layer_ids)
        self.num_rows_per_layer = hasher.num_rows_per_layer
        self.vocab = hasher.vocab
        self.pad_cid = hasher.pad_cid

        def dev(a: object) -> Tensor:
            return torch.as_tensor(a, dtype=torch.int64).to(self.device)

        self.token_map = dev(hasher.token_map)  # [vocab]
        self.multipliers = dev(hasher.multipliers)  # [layers, max_ngram]
        # [layers, max_ngram-1, heads]: block (n = s+1, h) of every layer
        shape = (self.num_layers, self.history_len, self.n_heads)
        self.primes = dev(hasher.primes).reshape(shape)
        self.offsets = dev(hasher.offsets).reshape(shape)

    def compressed_ids(self, token_ids: Tensor) -> Tensor:
        """Compressed id of every entry (any shape, int64); ``DEAD`` for -1 (no such position) and for every id
        at or past the token map (image ids; ids past the image span cannot reach here: the host checks the
        step's ids and sampled ids lie in the vocabulary)."""
        text = (token_ids >= 0) & (token_ids < self.vocab)
        cid = self.token_map[token_ids.clamp(0, self.vocab - 1)]
        return torch.where(text, cid, torch.full_like(cid, DEAD))

    def rows(self, token_ids: Tensor, prev: Tensor) -> Tensor:
        """Row ids ``[T, num_layers, (max_ngram-1)*n_heads] int64`` of ``token_ids [T] int64``.

        ``prev [T, max_ngram-1] int64``: column s-1 holds the id at position p-s of the token's sequence, -1 where
        p-s < 0 or the id is unknown (a fresh slot); a DEAD or missing position blocks it and everything older,
        which then hash as the pad id (the reference's rule)."""
        T, K = token_ids.shape[0], self.history_len
        if token_ids.dim() != 1 or prev.shape != (T, K):
            raise InputError(f"engram device hash: found ids {tuple(token_ids.shape)} and predecessors "
                             f"{tuple(prev.shape)}, expected [T] and [T, {K}]")  # fmt: skip
        cid = self.compressed_ids(torch.cat([token_ids[:, None], prev], dim=1))  # [T, max_ngram], s = 0..K
        blocked = (cid == DEAD).to(torch.int64).cummax(dim=1).values.bool()
        val = torch.where(blocked, torch.full_like(cid, self.pad_cid), cid)
        terms = val[:, None, :] * self.multipliers[None]  # [T, layers, max_ngram]: no overflow (M's bound)
        r = terms[:, :, 0]
        cols = []
        for s in range(1, K + 1):  # max_ngram is a config constant: a fixed unrolled loop
            r = r ^ terms[:, :, s]
            cols.append(r[:, :, None] % self.primes[None, :, s - 1] + self.offsets[None, :, s - 1])
        return torch.stack(cols, dim=2).reshape(T, self.num_layers, self.num_rows_per_layer)
