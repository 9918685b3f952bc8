"""Build a `Transformer` from a checkpoint directory through per-parameter weight loaders.

Every checkpoint tensor name maps to one parameter (and, for routed experts, one slot of a stacked ``[E, ...]``
parameter) by the one name table in `weight_names.py`; missing / unexpected tensors and shape mismatches raise
`CheckpointError`. By default the model keeps the checkpoint's storage formats (FP8 e4m3 + UE8M0 block scales,
FP4 e2m1 experts packed two per byte + scales, FP8 Engram tables): parameters of those formats receive the raw
stored tensors, the others the decoded tensor in their own dtype (bf16 / fp32 as stored, cast to the model
dtype where the model computes in it). `quantized=False` decodes everything at load instead (dense model).
Once filled, the FP8 Linears that read the same input share one weight buffer (`linear_pair.fuse_model_pairs`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from deepinfer_engine.errors import CheckpointError
from deepinfer_engine.model.inventory import optional_tensor_names
from deepinfer_engine.model.linear import QUANTIZED_DTYPES, default_weight_loader
from deepinfer_engine.model.linear_pair import fuse_model_pairs
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.moe import EXPERT_LAYOUTS, chunk_model_experts
from deepinfer_engine.model.weight_names import (
    MODULE_TO_CHECKPOINT,
    checkpoint_name,
    checkpoint_to_param,
    param_to_checkpoint,
)

__all__ = [
    "MODULE_TO_CHECKPOINT",
    "checkpoint_name",
    "checkpoint_to_param",
    "expected_checkpoint_tensors",
    "load_model",
    "load_state_into",
    "load_weights",
]

DRAFT_PREFIX = "mtp."
_STACKED_EXPERT = re.compile(r"\.ffn\.experts\.w[123]\.(weight|scale)$")


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    named = dict(model.named_parameters(remove_duplicate=False))
    named.update(model.named_buffers(remove_duplicate=False))
    return named


def _held_experts(model: torch.nn.Module, pname: str) -> tuple[int, ...] | None:
    """Checkpoint expert of each slot of a stacked expert parameter whose module holds a subset of the layer's
    experts (`Experts.hold_experts`, expert parallelism); None for every other parameter."""
    if _STACKED_EXPERT.search(pname) is None:
        return None
    mod = model.get_submodule(pname.rsplit(".", 2)[0])
    return getattr(mod, "held_experts", None)


def _checkpoint_targets(model: torch.nn.Module) -> dict[str, list[tuple[str, int | None]]]:
    """checkpoint tensor name -> every (parameter / buffer name, expert slot) it fills: one target, except an
    expert a rank holds in several slots (EPLB replicas)."""
    out: dict[str, list[tuple[str, int | None]]] = {}
    for pname, t in _named_tensors(model).items():
        held = _held_experts(model, pname)
        if held is None:
            for ck, slot in param_to_checkpoint(pname, t.shape[0] if t.dim() else 0):
                out.setdefault(ck, []).append((pname, slot))
            continue
        names = param_to_checkpoint(pname, max(held) + 1)  # entry e names expert e's tensor
        for slot, e in enumerate(held):
            out.setdefault(names[e][0], []).append((pname, slot))
    return out


def expected_checkpoint_tensors(model: torch.nn.Module) -> dict[str, tuple[str, int | None]]:
    """checkpoint tensor name -> (parameter / buffer name, expert slot) for every tensor the model holds (the
    first slot when a rank holds an expert in several)."""
    return {ck: targets[0] for ck, targets in _checkpoint_targets(model).items()}


def _skipped_experts(model: torch.nn.Module, stored: set[str]) -> set[str]:
    """Stored expert tensors of layers whose module holds a subset of the experts: the ones not held are left
    in the checkpoint (another rank loads them), not reported as unexpected."""
    partial = {pname.rsplit(".", 2)[0] for pname in _named_tensors(model) if _held_experts(model, pname)}
    out = set()
    for ck in stored:
        pname, slot = checkpoint_to_param(ck)
        if slot is not None and pname.rsplit(".", 2)[0] in partial:
            out.add(ck)
    return out


def _is_scale_companion(name: str, stored: set[str]) -> bool:
    # FP8/FP4 weights `X.weight` come with `X.scale`; mHC `*_scale` parameters do not end in ".scale".
    return name.endswith(".scale") and name[: -len("scale")] + "weight" in stored


def _check_expert_layout(expert_layout: str) -> None:
    if expert_layout not in EXPERT_LAYOUTS:
        raise CheckpointError(f"expert_layout {expert_layout!r}: expected one of {EXPERT_LAYOUTS}")


def _after_load(model: torch.nn.Module, expert_layout: str) -> None:
    """Post-load transformations, in place: same-input FP8 Linears into one buffer each (linear_pair.py), then
    the FP4 routed experts on CUDA into the chunked layout when asked (moe.py `chunk_model_experts`)."""
    fuse_model_pairs(model)
    if expert_layout == "chunked":
        chunk_model_experts(model)


def _load_one(target: torch.Tensor, tensor: torch.Tensor, slot: int | None, ck: str) -> None:
    loader = getattr(target, "weight_loader", default_weight_loader)
    try:
        loader(target, tensor, slot)
    except CheckpointError as exc:
        raise CheckpointError(f"tensor '{ck}': {exc}") from None


def _materialize(model: torch.nn.Module, device: torch.device | str) -> None:
    """Give every meta parameter / buffer uninitialized storage on `device` (same objects, so the weight_loader
    attributes and any sharing survive)."""
    named = _named_tensors(model)
    if not any(t.is_meta for t in named.values()):
        return
    # to_empty makes new Parameter objects when the device changes: carry the loader attributes over
    extras = {n: dict(vars(t)) for n, t in named.items() if vars(t)}
    model.to_empty(device=device)
    after = _named_tensors(model)
    for n, attrs in extras.items():
        for k, v in attrs.items():
            setattr(after[n], k, v)


@torch.no_grad()
def load_weights(
    model: Transformer, weights: object, *, device: torch.device | str | None = None, expert_layout: str = "checkpoint"
) -> None:
    """Load `(checkpoint name, tensor)` pairs (decoded float tensors, or stored ones for quantized parameters)
    through the parameters' weight loaders; every tensor of the model must be given exactly once. expert_layout:
    as in `load_model`."""
    _check_expert_layout(expert_layout)
    expected = expected_checkpoint_tensors(model)
    _materialize(model, device or "cpu")
    named = _named_tensors(model)
    seen: set[str] = set()
    for ck, t in weights.items() if hasattr(weights, "items") else weights:
        if ck not in expected:
            raise CheckpointError(f"tensor '{ck}' is not part of the model built from its config")
        pname, slot = expected[ck]
        _load_one(named[pname], t, slot, ck)
        seen.add(ck)
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{len(missing)} model tensors were not given: {missing[:6]}")
    _after_load(model, expert_layout)


@torch.no_grad()
def load_state_into(
    model: Transformer, reader: object, *, device: torch.device | str = "cpu", expert_layout: str = "checkpoint"
) -> None:
    """Fill every model tensor from `reader` (anything with `tensor_names()`, `load(name, dtype, device)` and
    `load_raw(name)`): quantized parameters get the stored tensors, dense ones the decoded tensor. expert_layout:
    as in `load_model`."""
    _check_expert_layout(expert_layout)
    stored = set(reader.tensor_names())
    if not model.with_draft:
        stored = {n for n in stored if not n.startswith(DRAFT_PREFIX)}
    targets = _checkpoint_targets(model)
    expected = set(targets)
    missing = sorted(expected - stored)
    # tensors the inventory declares optional (present or not in a release, never read) are dropped here, and
    # so are the experts another rank holds
    optional = optional_tensor_names(model.args) | _skipped_experts(model, stored)
    unexpected = sorted(n for n in stored - set(expected) - optional if not _is_scale_companion(n, stored))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint tensors do not match the model built from its config: {len(missing)} missing "
            f"{missing[:6]}, {len(unexpected)} unexpected {unexpected[:6]}"
        )
    _materialize(model, device)
    named = _named_tensors(model)
    for ck, places in targets.items():
        target = named[places[0][0]]
        if target.dtype in QUANTIZED_DTYPES or ck.endswith(".scale"):
            t = reader.load_raw(ck)
        else:
            t = reader.load(
                ck, dtype=target.dtype if target.is_floating_point() else torch.float32, device=device
            )
        for pname, slot in places:
            _load_one(named[pname], t, slot, ck)
    _after_load(model, expert_layout)


def load_model(
    ckpt_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    *,
    with_draft: bool = True,
    token_map: object | None = None,
    quantized: bool = True,
    quantize_activations: bool = False,
    expert_slots: Callable[[int], Sequence[int]] | None = None,
    token_map_cache: str | os.PathLike[str] | None = "auto",
    expert_layout: str = "checkpoint",
) -> Transformer:
    """Transformer holding the weights of `ckpt_dir` on `device`: in their checkpoint formats (quantized=True,
    the default) or decoded to `dtype`; float parameters in `dtype`, fp32 where the spec keeps fp32 (mHC,
    sinks, ape, gate bias, compressor projections). quantize_activations: FP8 activation quantization before
    every FP8 GEMM (deployed numerics). Engram models get their hasher from `token_map` or the directory's
    tokenizer.json (docs/model.md §C.6 token map), memoised on disk per tokenizer content in `token_map_cache`
    (`engram_hash.cached_token_map`; "auto": `engram-token-maps` in the deepinfer cache, None: rebuilt on every
    load: decoding the whole vocabulary takes seconds). expert_slots: expert parallelism, `layer id -> the checkpoint
    experts of this rank's slots` for every backbone MoE layer; only those are read (draft layers keep all).
    expert_layout: "checkpoint" keeps the FP4 routed experts' bytes as stored; "chunked" repacks those on a CUDA
    device once after loading, in place, into the layout the GPU kernels read with coalesced 16-byte loads
    (deepinfer_kernels.moe.fp4_layout, docs/moe_fp4_kernel.md; same tensors, shapes and dtypes)."""
    from deepinfer_engine.model.checkpoint import CheckpointReader

    reader = CheckpointReader(ckpt_dir)
    try:
        # build on the meta device (no storage, no init kernels), then give every tensor storage on the target
        # device once and fill it from the reader: peak memory = the model once, in its stored formats
        with torch.device("meta"):
            model = Transformer(
                reader.args, dtype, with_draft=with_draft, quantized=quantized,
                quantize_activations=quantize_activations,
            )  # fmt: skip
        if expert_slots is not None:
            for layer in model.layers:
                experts = layer.ffn.experts
                experts.hold_experts(expert_slots(layer.layer_id), len(experts))
        load_state_into(model, reader, device=device, expert_layout=expert_layout)
    finally:
        reader.close()
    left = [n for n, v in _named_tensors(model).items() if v.is_meta]
    if left:
        raise CheckpointError(f"tensors not materialized from the checkpoint (still on meta): {left[:6]}")
    if reader.args.engram_layer_ids:
        if token_map is None:
            from deepinfer_engine.model.checkpoint_files import load_tokenizer
            from deepinfer_engine.model.engram_hash import cached_token_map, compressed_token_map

            tok = Path(ckpt_dir) / "tokenizer.json"
            if not tok.is_file():
                raise CheckpointError(
                    f"{str(ckpt_dir)!r}: Engram layers need tokenizer.json for the compressed token map, found none"
                )
            # parsed through the validating loader: a garbage tokenizer.json is a CheckpointError naming the file
            def build() -> object:
                return compressed_token_map(load_tokenizer(tok, required=False))

            if token_map_cache == "auto":
                from deepinfer_engine.cache_root import cache_root

                token_map_cache = cache_root() / "engram-token-maps"
            token_map = build() if token_map_cache is None else cached_token_map(tok, token_map_cache, build)
        model.set_engram_token_map(token_map)
    return model.eval()
