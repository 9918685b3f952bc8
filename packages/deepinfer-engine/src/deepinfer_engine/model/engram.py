"""V4.1 Engram n-gram memory injection (docs/model.md §C.6), applied to the hc streams before a layer's
attention mixes.

Row ids depend only on token ids, so one computation per forward serves every engram layer: the model computes
``ctx.engram_rows`` on the device (engram_hash_device.py, from the step's ids and the cache's device token ring,
docs/async_scheduling.md) and hands each layer its column. ``engram_row_ids`` is the host form of the same
ids through ``EngramHasher`` (numpy, the reference).
"""

from __future__ import annotations

import numpy as np
import torch
from deepinfer_kernels.engram import engram_gate as _engram_gate
from deepinfer_kernels.engram import engram_inject, lookup_rows
from torch import Tensor, nn

from deepinfer_engine.errors import InputError, ModelConfigError
from deepinfer_engine.model.linear import Linear, new_param, stored_torch_dtype


def engram_gate(r: Tensor, key: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
    """Per-stream Engram gate (docs/model.md §C.6) [T, n] float32 of streams r [T, n, d] and keys [T, n, d]
    (deepinfer_kernels.engram.engram_gate: the reference the Triton injection is tested against)."""
    return _engram_gate(r, key, q_weight, k_weight, eps)


class _Table(nn.Module):
    """``engram.embed.weight [N, head_dim]``: dense, or as stored (FP8 e4m3 rows + ``embed.scale [N, head_dim/32]``
    UE8M0, decoded per looked-up row: the tables are the largest tensors of V4.1 and stay FP8 in memory)."""

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)

    def __init__(self, rows: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(rows, dim))
        self.scale: nn.Parameter | None = None
        self.group = dim

    def use_checkpoint_format(self, stored: str, scale_dtype: str, block: tuple[int, int]) -> None:
        if stored != "f8_e4m3" or block[0] != 1:
            raise ModelConfigError(f"engram table: stored {stored!r} block {block}, expected f8_e4m3 rows (1, g)")
        rows, dim = self.weight.shape
        self.weight = new_param((rows, dim), torch.float8_e4m3fn, self.weight)
        self.scale = new_param((rows, -(-dim // block[1])), stored_torch_dtype(scale_dtype), self.weight)
        self.group = block[1]

    def lookup(self, row_ids: Tensor, dtype: torch.dtype) -> Tensor:
        """row_ids [...] int64 -> rows [..., head_dim] in `dtype` (exact decode of the gathered rows only)."""
        if self.scale is None:
            return self.weight[row_ids].to(dtype)
        # gathers, decode, scale and cast in one launch where the kernel runs (deepinfer_kernels.engram)
        return lookup_rows(self.weight, self.scale, row_ids, self.group, dtype, backend=self.kernel_backend)


class Engram(nn.Module):
    """``layers.{l}.engram.{embed.weight, wkv.weight, q_weight, k_weight}`` (docs/model.md §C.6).

    embed: ``[N_l, head_dim]``; wkv: ``[(hc_mult+1)·d, num_lookups·head_dim]`` with num_lookups =
    ``(max_ngram-1)·n_heads`` (keys of the hc_mult streams, then the value); q_weight, k_weight: ``[hc_mult, d]``.
    Row ids are hashed once per forward for all engram layers (``engram_row_ids``, called by the model).
    """

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)

    def __init__(
        self, *, dim: int, hc_mult: int, num_embeddings: int, head_dim: int, num_lookups: int, eps: float
    ) -> None:
        super().__init__()
        self.dim, self.hc_mult, self.num_lookups, self.eps = dim, hc_mult, num_lookups, eps
        self.embed = _Table(num_embeddings, head_dim)
        self.wkv = Linear(num_lookups * head_dim, (hc_mult + 1) * dim, torch.float32)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, dim))
        self.k_weight = nn.Parameter(torch.ones(hc_mult, dim))

    def forward(self, r: Tensor, row_ids: Tensor, image_mask: Tensor | None) -> Tensor:
        """r: ``[T, hc, d]`` streams; row_ids: ``[T, num_lookups] int64`` (this layer's column of
        ``engram_row_ids``); image_mask: ``[T] bool`` or None. Returns ``R_i + gate_i · val`` in ``r.dtype``."""
        return self.inject(r, self.project(row_ids), image_mask)

    def project(self, row_ids: Tensor) -> Tensor:
        """row_ids ``[T, num_lookups] int64`` -> kv ``[T, hc_mult + 1, d]`` in wkv's dtype (the keys of the streams,
        then the value). Token ids only: a decode step runs it beside the previous layer (overlap.py)."""
        t = row_ids.shape[0]
        if row_ids.dim() != 2 or row_ids.shape[1] != self.num_lookups:
            raise InputError(
                f"engram row_ids: found {tuple(row_ids.shape)}, expected [T, {self.num_lookups}]"
            )
        e = self.embed.lookup(row_ids, self.wkv.dtype).reshape(t, -1)  # [T, lookups * head_dim], model dtype
        return self.wkv(e).view(t, self.hc_mult + 1, self.dim)

    def inject(self, r: Tensor, kv: Tensor, image_mask: Tensor | None) -> Tensor:
        """r ``[T, hc, d]``, kv from `project` of the same rows -> ``R_i + gate_i · val`` in ``r.dtype``."""
        if kv.shape[0] != r.shape[0]:
            raise InputError(f"engram kv: found {kv.shape[0]} rows, expected the streams' {r.shape[0]}")
        keys, val = kv[:, : self.hc_mult], kv[:, self.hc_mult]
        # gate [T, hc] (0 at image positions: they pass through unchanged), then R_i + gate_i * val
        return engram_inject(r, keys, val, self.q_weight, self.k_weight, self.eps, image_mask,
                             backend=self.kernel_backend)


def engram_row_ids(
    hasher: object, input_ids: Tensor, query_lens: tuple[int, ...], token_history: Tensor
) -> Tensor:
    """Row ids of every engram layer for one forward: ``[T, num_engram_layers, num_lookups] int64``.

    token_history: ``[T, max_ngram] int64`` ids at positions ``p-max_ngram+1 .. p`` (-1 for p < 0), as in
    ``ForwardContext.token_history``; only each sequence's first row is needed (its previous ids), the rest
    come from ``input_ids``. Image ids (past the vocabulary) are DEAD in the hasher, so n-grams break across them.
    """
    hist_len = int(hasher.history_len)
    if token_history.dim() != 2 or token_history.shape[1] < hist_len + 1:
        raise InputError(
            f"token_history: found {tuple(token_history.shape)}, expected [T, >= {hist_len + 1}] (max_ngram)"
        )
    histories, start = [], 0
    hist_np = token_history.cpu().numpy()
    for n in query_lens:
        prev = hist_np[start, -hist_len - 1 : -1]
        histories.append(prev[prev >= 0])  # -1 = before the sequence start
        start += n
    rows = hasher.hash_batch(input_ids.cpu().numpy().astype(np.int64), query_lens, histories)
    return torch.from_numpy(np.ascontiguousarray(rows)).to(device=input_ids.device, dtype=torch.int64)


def engram_layer_index(engram_layer_ids: tuple[int, ...], layer_id: int) -> int:
    """Column of ``engram_row_ids`` output that belongs to ``layer_id``."""
    if layer_id not in engram_layer_ids:
        raise ModelConfigError(f"engram_layer_ids: layer {layer_id} not in {list(engram_layer_ids)}")
    return engram_layer_ids.index(layer_id)
