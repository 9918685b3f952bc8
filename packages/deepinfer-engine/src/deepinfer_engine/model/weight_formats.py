"""Switch a freshly built model to the checkpoint's storage formats, driven by the tensor inventory.

The inventory (inventory.py) says which tensors are stored quantized (FP8 e4m3 with block scales, FP4 e2m1
experts, FP8 Engram tables); every module owning one must implement ``use_checkpoint_format(stored,
scale_dtype, block)``, so no quantized tensor is silently widened. Call it before loading (load_model does).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from deepinfer_engine.errors import ModelConfigError
from deepinfer_engine.model.inventory import TensorSpec, tensor_inventory
from deepinfer_engine.model.linear import Linear
from deepinfer_engine.model.weight_names import checkpoint_to_param

__all__ = ["apply_checkpoint_formats", "resident_bytes"]


def apply_checkpoint_formats(
    model: nn.Module,
    args: object,
    *,
    quantize_activations: bool = False,
    specs: Iterable[TensorSpec] | None = None,
) -> None:
    """Every module holding a quantized checkpoint tensor switches to its stored format (in place).

    quantize_activations: FP8 Linears quantize their input to e4m3 per 1 x block channels (deployed numerics).
    specs: the tensor inventory of `args` when the caller already has it (it is large for the real configs)."""
    seen: set[str] = set()
    with_draft = getattr(model, "with_draft", True)
    for spec in tensor_inventory(args) if specs is None else specs:
        if spec.scale is None:
            continue
        pname, _ = checkpoint_to_param(spec.name)
        if pname in seen:
            continue
        seen.add(pname)
        mod_name = pname.removesuffix(".weight")
        try:
            mod = model.get_submodule(mod_name)
        except AttributeError:
            if spec.section == "draft" and not with_draft:
                continue
            raise ModelConfigError(f"tensor '{spec.name}': the model has no module '{mod_name}'") from None
        use = getattr(mod, "use_checkpoint_format", None)
        if use is None:
            raise ModelConfigError(
                f"tensor '{spec.name}' is stored {spec.dtype} but module '{mod_name}' ({type(mod).__name__}) "
                "cannot hold that format"
            )
        use(spec.dtype, spec.scale.dtype, spec.scale.block)
        if quantize_activations and isinstance(mod, Linear):
            mod.quantize_activations = True


def resident_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes the model holds in parameters + buffers, by torch dtype name (shared tensors counted once)."""
    out: dict[str, int] = {}
    seen: set[int] = set()
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) in seen:
            continue
        seen.add(id(t))
        key = str(t.dtype).removeprefix("torch.")
        out[key] = out.get(key, 0) + t.numel() * t.element_size()
    return out
