"""Test harness (used by the model tests): random init of a Transformer and the equality runs
full forward == token-by-token decode == chunked prefill == batched with other sequences.

Every run returns per-token logits [n, V] float32 for each sequence, so results compare row by row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch
from torch import Tensor, nn

__all__ = ["init_random_", "max_rel_err", "random_chunks", "run_batched", "run_chunked", "run_full"]


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0, *, vocab_for_hash: int | None = None) -> nn.Module:
    """Fill every parameter/buffer with seeded random values of a sensible scale (in place; returns model).

    2-D weights ~ N(0, 1/fan_in); norm weights 1 + N(0, 0.1); mHC fn small; biases, sinks, ape non-zero so that
    every term of the forward matters; `tid2eid` distinct random expert ids per token.
    """
    g = torch.Generator().manual_seed(seed)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":
            v, k = t.shape
            n_exp = getattr(model, "args", None).n_routed_experts if hasattr(model, "args") else k
            t.copy_(torch.argsort(torch.rand(v, n_exp, generator=g), dim=-1)[:, :k])
            continue
        if not t.dtype.is_floating_point:
            continue
        if name.endswith("norm.weight") or leaf in ("q_weight", "k_weight"):
            val = 1.0 + 0.1 * torch.randn(t.shape, generator=g)
        elif leaf.endswith("_fn"):
            val = torch.randn(t.shape, generator=g) * (0.5 / t.shape[-1] ** 0.5)
        elif leaf.endswith("_base"):
            val = 0.5 * torch.randn(t.shape, generator=g)
        elif leaf.endswith("_scale"):
            val = 0.5 + 0.5 * torch.rand(t.shape, generator=g)
        elif leaf in ("attn_sink", "ape", "bias", "bias_vl"):
            val = 0.5 * torch.randn(t.shape, generator=g)
        elif t.dim() >= 2:  # [out, in] weights and stacked [E, out, in] experts: N(0, 1/fan_in)
            val = torch.randn(t.shape, generator=g) / t.shape[-1] ** 0.5
        else:
            val = torch.randn(t.shape, generator=g)
        t.copy_(val.to(t.dtype))
    return model


def max_rel_err(a: Tensor, b: Tensor) -> float:
    """max |a - b| / max |b| (b = reference)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-30))


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _cache_for(model: nn.Module, lens: Sequence[int], page_size: int | None) -> tuple[ModelCache, Tensor]:
    # cache, block tables and ids follow the model's device, so the same runs work on CPU and CUDA
    return ModelCache.allocate_dense(model.args, list(lens), dtype=model.dtype, page_size=page_size,
                                     device=_device(model))


@torch.no_grad()
def run_full(model: nn.Module, ids: Tensor, *, page_size: int | None = None) -> Tensor:
    """One forward over the whole sequence: [n, V]."""
    cache, bt = _cache_for(model, [ids.numel()], page_size)
    return model(ForwardBatch.single(ids.to(_device(model)), block_table=bt[0]), cache)


@torch.no_grad()
def run_chunked(model: nn.Module, ids: Tensor, chunks: Sequence[int], *, page_size: int | None = None) -> Tensor:
    """Prefill in the given chunk sizes (sum = len(ids)); chunks of 1 = token-by-token decode. [n, V]."""
    if sum(chunks) != ids.numel():
        raise ValueError(f"chunks {list(chunks)} do not sum to {ids.numel()}")
    cache, bt = _cache_for(model, [ids.numel()], page_size)
    ids = ids.to(_device(model))
    out, s = [], 0
    for c in chunks:
        out.append(model(ForwardBatch.single(ids[s : s + c], start_pos=s, block_table=bt[0]), cache))
        s += c
    return torch.cat(out, 0)


def random_chunks(n: int, gen: torch.Generator, max_chunk: int = 12) -> list[int]:
    out, s = [], 0
    while s < n:
        c = int(torch.randint(1, max_chunk + 1, (1,), generator=gen))
        c = min(c, n - s)
        out.append(c)
        s += c
    return out


@torch.no_grad()
def run_batched(
    model: nn.Module, seqs: Sequence[Tensor], *, seed: int = 0, max_chunk: int = 12, page_size: int | None = None
) -> list[Tensor]:
    """All sequences together in one cache; each step every unfinished sequence adds a random chunk (order and
    slot assignment shuffled). Returns per-sequence [n_i, V]."""
    gen = torch.Generator().manual_seed(seed)
    lens = [int(s.numel()) for s in seqs]
    slot_of = torch.randperm(len(seqs), generator=gen).tolist()  # sequence i lives in slot slot_of[i]
    lens_by_slot = [0] * len(seqs)
    for i, s in enumerate(slot_of):
        lens_by_slot[s] = lens[i]
    cache, bt = _cache_for(model, lens_by_slot, page_size)  # block table row k belongs to slot k
    done = [0] * len(seqs)
    outs: list[list[Tensor]] = [[] for _ in seqs]
    while any(d < n for d, n in zip(done, lens)):
        active = [i for i in range(len(seqs)) if done[i] < lens[i]]
        order = [active[j] for j in torch.randperm(len(active), generator=gen).tolist()]
        ids, pos, qlens, slots, rows = [], [], [], [], []
        for i in order:
            c = min(int(torch.randint(1, max_chunk + 1, (1,), generator=gen)), lens[i] - done[i])
            ids.append(seqs[i][done[i] : done[i] + c])
            pos.append(torch.arange(done[i], done[i] + c))
            qlens.append(c)
            slots.append(slot_of[i])
            rows.append(bt[slot_of[i]])
        # block tables are allocated per slot by allocate_dense; rows follow the batch's sequence order
        dev = _device(model)
        batch = ForwardBatch(
            input_ids=torch.cat(ids).to(dev, torch.int64),
            positions=torch.cat(pos).to(dev, torch.int64),
            query_lens=tuple(qlens),
            slots=tuple(slots),
            block_tables=torch.stack(rows).to(dev),
            logits_indices=torch.arange(sum(qlens), dtype=torch.int64, device=dev),
        )
        logits = model(batch, cache)
        s = 0
        for i, c in zip(order, qlens):
            outs[i].append(logits[s : s + c])
            done[i] += c
            s += c
    return [torch.cat(o, 0) for o in outs]
