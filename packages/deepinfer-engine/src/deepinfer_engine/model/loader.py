"""Build a `Transformer` from a checkpoint directory: every parameter by its checkpoint name (C's
`CheckpointReader`, dequantized), shapes checked, missing / unexpected tensors rejected with `CheckpointError`.

The one name table (`MODULE_TO_CHECKPOINT`) is the identity today: module names were chosen equal to the official
reference names (architecture.md §6). A rename, if ever needed, goes into that table and nowhere else.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import MappingProxyType

import torch

from deepinfer_engine.errors import CheckpointError
from deepinfer_engine.model.inventory import optional_tensor_names
from deepinfer_engine.model.model import Transformer

__all__ = ["MODULE_TO_CHECKPOINT", "checkpoint_name", "load_model", "load_state_into"]

# module state-dict name -> official checkpoint name, where they differ (none so far).
MODULE_TO_CHECKPOINT: MappingProxyType[str, str] = MappingProxyType({})

DRAFT_PREFIX = "mtp."


def checkpoint_name(module_name: str) -> str:
    return MODULE_TO_CHECKPOINT.get(module_name, module_name)


def _is_scale_companion(name: str, stored: set[str]) -> bool:
    # FP8/FP4 weights `X.weight` come with `X.scale`; mHC `*_scale` parameters do not end in ".scale".
    return name.endswith(".scale") and name[: -len("scale")] + "weight" in stored


@torch.no_grad()
def load_state_into(model: Transformer, reader: object, *, device: torch.device | str = "cpu") -> None:
    """Copy every model tensor from `reader` (anything with `tensor_names()` and `load(name, dtype, device)`)."""
    state = model.state_dict(keep_vars=True)
    stored = set(reader.tensor_names())
    weights = {n for n in stored if not _is_scale_companion(n, stored)}
    if not model.with_draft:
        weights = {n for n in weights if not n.startswith(DRAFT_PREFIX)}
    wanted = {checkpoint_name(k): k for k in state}
    missing = sorted(set(wanted) - weights)
    # tensors the inventory declares optional (present or not in a release, never read) are dropped here
    unexpected = sorted(weights - set(wanted) - optional_tensor_names(model.args))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint tensors do not match the model built from its config: {len(missing)} missing "
            f"{missing[:6]}, {len(unexpected)} unexpected {unexpected[:6]}"
        )
    # Parameters may live on the meta device (load_model builds there): every one is replaced by the tensor read
    # from the checkpoint on `device` (no placeholder storage, no CPU staging copy). Parameters shared by several
    # names stay shared (keyed by the placeholder's identity).
    replaced: dict[int, torch.Tensor] = {}
    owners = {name: mod for name, mod in model.named_modules(remove_duplicate=False)}
    for ck, mod_name in wanted.items():
        target = state[mod_name]
        t = reader.load(ck, dtype=target.dtype if target.is_floating_point() else torch.float32, device=device)
        if tuple(t.shape) != tuple(target.shape):
            raise CheckpointError(
                f"tensor '{ck}': checkpoint shape {list(t.shape)}, expected {list(target.shape)} from config.json"
            )
        t = t.to(device=device, dtype=target.dtype)
        done = replaced.get(id(target))
        if done is not None:
            done.data = t
            continue
        owner_name, _, attr = mod_name.rpartition(".")
        owner = owners[owner_name]
        if attr in owner._parameters:
            new: torch.Tensor = torch.nn.Parameter(t, requires_grad=target.requires_grad)
            owner._parameters[attr] = new
        else:
            new = t
            owner._buffers[attr] = new
        replaced[id(target)] = new
        # the same placeholder may be registered under other module names (tied weights): point them here too
        for other in (n for n, v in state.items() if v is target and n != mod_name):
            o_name, _, o_attr = other.rpartition(".")
            reg = owners[o_name]._parameters if o_attr in owners[o_name]._parameters else owners[o_name]._buffers
            reg[o_attr] = new


def load_model(
    ckpt_dir: str | os.PathLike[str],
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    *,
    with_draft: bool = True,
    token_map: object | None = None,
) -> Transformer:
    """Transformer holding the dequantized weights of `ckpt_dir` (parameters in `dtype`, fp32 where the spec
    keeps fp32: mHC, sinks, ape, gate bias, compressor projections). Engram models get their hasher from
    `token_map` or the directory's tokenizer.json (architecture.md §C.6 token map)."""
    from deepinfer_engine.model.checkpoint import CheckpointReader

    reader = CheckpointReader(ckpt_dir)
    try:
        # build on the meta device (no storage, no init kernels), then materialize every parameter straight from
        # the reader on the target device: peak memory = the model once, real-width checkpoints fit a GPU
        with torch.device("meta"):
            model = Transformer(reader.args, dtype, with_draft=with_draft)
        load_state_into(model, reader, device=device)
    finally:
        reader.close()
    left = [n for n, v in [*model.named_parameters(), *model.named_buffers()] if v.is_meta]
    if left:
        raise CheckpointError(f"tensors not materialized from the checkpoint (still on meta): {left[:6]}")
    if reader.args.engram_layer_ids:
        if token_map is None:
            from deepinfer_engine.model.checkpoint_files import load_tokenizer
            from deepinfer_engine.model.engram_hash import compressed_token_map

            tok = Path(ckpt_dir) / "tokenizer.json"
            if not tok.is_file():
                raise CheckpointError(
                    f"{str(ckpt_dir)!r}: Engram layers need tokenizer.json for the compressed token map, found none"
                )
            # parsed through the validating loader: a garbage tokenizer.json is a CheckpointError naming the file
            token_map = compressed_token_map(load_tokenizer(tok, required=False))
        model.set_engram_token_map(token_map)
    return model.eval()
