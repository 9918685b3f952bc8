"""Engram row ids on the device (docs/async_scheduling.md): the same int64 values as `EngramHasher.hash_batch`
(engram_hash.py, numpy, the reference), from device tensors and in pure torch integer ops: no host read, no
data-dependent shape, so a CUDA graph can capture it and an asynchronous step can hash ids that only exist on the
device (placeholders resolved from the previous step's samples).

The caller hands each token's predecessors explicitly (``prev [T, max_ngram-1]``: the ids at positions p-1, p-2, ..
or -1 where the sequence has no such position); token_ring.ring_step gathers them from the step's ids and the cache's
device token ring. Arithmetic is the reference's: ``val * M`` stays below 2**63 by the multipliers' bound
(engram_multipliers), XOR keeps values non-negative, so ``r % prime`` is the same floor remainder in numpy and torch.
"""

from __future__ import annotations

import numpy as np
import torch
from deepinfer_kernels.engram import hash_rows
from torch import Tensor

from deepinfer_engine.errors import InputError
from deepinfer_engine.model.engram_hash import DEAD, EngramHasher
from deepinfer_engine.model.image_ids import IMAGE_ID_SPAN

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

        # compressed id of id + 1 for ids -1 .. vocab + IMAGE_ID_SPAN - 1: DEAD for -1 (no such position) and for
        # image ids, the token map in between -- one gather per lookup instead of range tests
        table = np.full(self.vocab + IMAGE_ID_SPAN + 1, DEAD, dtype=np.int64)
        table[1 : self.vocab + 1] = hasher.token_map
        self.cid_table = dev(table)
        self.multipliers = dev(hasher.multipliers)  # [layers, max_ngram]
        # [layers, max_ngram-1, heads]: block (n = s+1, h) of every layer
        shape = (self.num_layers, self.history_len, self.n_heads)
        self.primes = dev(hasher.primes).reshape(shape)
        self.offsets = dev(hasher.offsets).reshape(shape)

    def compressed_ids(self, token_ids: Tensor) -> Tensor:
        """Compressed id of every entry (any shape, int64); ``DEAD`` for -1 (no such position) and for image ids
        ``[vocab, vocab + IMAGE_ID_SPAN)``. Ids outside that range cannot reach here (the host checks the step's
        ids; sampled ids lie in the vocabulary); the clamp only keeps the gather in bounds."""
        return self.cid_table[(token_ids + 1).clamp_(0, self.cid_table.shape[0] - 1)]

    def rows(self, token_ids: Tensor, prev: Tensor, *, backend: str = "auto") -> Tensor:
        """Row ids ``[T, num_layers, (max_ngram-1)*n_heads] int64`` of ``token_ids [T] int64``.

        ``prev [T, max_ngram-1] int64``: column s-1 holds the id at position p-s of the token's sequence, -1 where
        p-s < 0 or the id is unknown (a fresh slot); a DEAD or missing position blocks it and everything older,
        which then hash as the pad id (the reference's rule). backend: the kernel backend
        (deepinfer_kernels.engram.hash_rows: one Triton launch on CUDA)."""
        T, K = token_ids.shape[0], self.history_len
        if token_ids.dim() != 1 or prev.shape != (T, K):
            raise InputError(f"engram device hash: found ids {tuple(token_ids.shape)} and predecessors "
                             f"{tuple(prev.shape)}, expected [T] and [T, {K}]")  # fmt: skip
        return hash_rows(token_ids, prev, self.cid_table, self.multipliers, self.primes, self.offsets,
                         self.pad_cid, backend=backend)  # fmt: skip
