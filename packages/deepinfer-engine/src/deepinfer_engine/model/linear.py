"""Linear layers whose weights stay in their checkpoint format, and the per-parameter weight loaders.

A `Linear` starts dense (``weight [out, in]`` in the model dtype); `use_checkpoint_format` switches it to the
stored format of its checkpoint tensor: FP8 e4m3 ``weight [out, in]`` + ``scale [ceil(out/b0), ceil(in/b1)]``
(UE8M0, or float32 for V4-Flash-Base experts), the names of the checkpoint (`X.weight`, `X.scale`). The forward
then decodes the weight inside the GEMM (`deepinfer_kernels.linear.fp8_linear`; the torch reference decodes per
call, exactly, so a float32 model computes the same numbers as with weights dequantized at load).
``quantize_activations`` rounds the input to FP8 e4m3 per 1 x b1 channels first (the deployed numerics).

Weight loaders (vLLM's idea): every parameter may carry ``weight_loader(param, tensor, expert_id)``; the model
loader calls it with the checkpoint tensor (stored format for quantized parameters, decoded float for dense
ones). Stacked expert parameters ``[E, ...]`` take checkpoint tensor ``...experts.{e}.w1.weight`` into slot e.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from deepinfer_kernels.linear import fp8_linear, fp8_linear_grouped, linear_f32_out, split_k_counters
from torch import Tensor, nn

from deepinfer_engine.errors import CheckpointError, ModelConfigError

__all__ = [
    "QUANTIZED_DTYPES",
    "Linear",
    "default_weight_loader",
    "new_param",
    "split_counters",
    "stacked_weight_loader",
    "stored_torch_dtype",
]

# torch dtypes of the stored (not decoded) formats: parameters of these dtypes are loaded raw
QUANTIZED_DTYPES = (torch.float8_e4m3fn, torch.int8, torch.float8_e8m0fnu)
_STORED_TORCH = {"f8_e4m3": torch.float8_e4m3fn, "fp4_e2m1x2": torch.int8, "f8_e8m0": torch.float8_e8m0fnu,
                 "f32": torch.float32, "bf16": torch.bfloat16}  # fmt: skip


def stored_torch_dtype(stored: str) -> torch.dtype:
    """Inventory dtype name (`f8_e4m3`, `fp4_e2m1x2`, `f8_e8m0`, ...) -> the torch dtype the loader keeps."""
    if stored not in _STORED_TORCH:
        raise ModelConfigError(f"stored dtype {stored!r}: expected one of {sorted(_STORED_TORCH)}")
    return _STORED_TORCH[stored]


def default_weight_loader(param: Tensor, loaded: Tensor, expert_id: int | None = None) -> None:
    """Copy a whole checkpoint tensor into `param` (shape must match; dtype converted)."""
    if expert_id is not None:
        raise CheckpointError(
            f"parameter {tuple(param.shape)} is not stacked but got expert slot {expert_id}"
        )
    if tuple(loaded.shape) != tuple(param.shape):
        raise CheckpointError(
            f"checkpoint shape {list(loaded.shape)}, expected {list(param.shape)} from config.json"
        )
    param.data.copy_(loaded)


def stacked_weight_loader(param: Tensor, loaded: Tensor, expert_id: int | None = None) -> None:
    """Copy expert `expert_id`'s checkpoint tensor into slot ``param[expert_id]`` of a stacked ``[E, ...]``."""
    if expert_id is None or not 0 <= expert_id < param.shape[0]:
        raise CheckpointError(
            f"stacked expert parameter {tuple(param.shape)}: expert slot {expert_id} out of range"
        )
    if tuple(loaded.shape) != tuple(param.shape[1:]):
        raise CheckpointError(
            f"checkpoint shape {list(loaded.shape)}, expected {list(param.shape[1:])} from config.json"
        )
    param.data[expert_id].copy_(loaded)


def new_param(
    shape: tuple[int, ...], dtype: torch.dtype, like: Tensor, loader: object = None
) -> nn.Parameter:
    """Uninitialized parameter on `like`'s device (meta while load_model builds), with an optional loader."""
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=like.device), requires_grad=False)
    if loader is not None:
        p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def split_counters(owner: nn.Module, device: torch.device) -> Tensor:
    """`owner`'s split-K arrival counters of the Triton GEMM on `device` (`deepinfer_kernels.linear.split_k_counters`),
    made on first use there. Every launch leaves them zero, so the GEMMs of `owner` need no zero fill per call
    (a CUDA graph of the decode step keeps no fill node). A plain attribute, not a buffer: no checkpoint tensor.
    One owner's GEMMs run one after the other on one stream."""
    c = owner.__dict__.get("_split_k_counters")
    if c is None or c.device != device:
        c = split_k_counters(device)
        owner.__dict__["_split_k_counters"] = c
    return c


class Linear(nn.Module):
    """y = x Wᵀ with `weight [out, in]` (checkpoint name `.weight`), input cast to the layer's compute dtype.

    Dense: `weight` in the compute dtype. Checkpoint format (`use_checkpoint_format`): FP8 `weight` + `scale`,
    decoded in the GEMM. `quantize_activations`: FP8 activation quantization before the GEMM (FP8 layers only).
    """

    kernel_backend = "auto"  # the model-wide backend resolved at build (Transformer.set_kernel_backend)
    pdl = False  # programmatic dependent launch where the kernel supports it (Transformer.set_pdl; docs/pdl.md)

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.compute_dtype: torch.dtype | None = None  # set when the weight leaves the compute dtype
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.scale: nn.Parameter | None = None
        self.block: tuple[int, int] | None = None
        self.quantize_activations = False

    def use_checkpoint_format(self, stored: str, scale_dtype: str, block: tuple[int, int]) -> None:
        """Hold the weight as stored: `stored` must be "f8_e4m3" (the only quantized dense format)."""
        if stored != "f8_e4m3":
            raise ModelConfigError(f"Linear: stored format {stored!r}, expected 'f8_e4m3'")
        b0, b1 = block
        shape = (self.out_features, self.in_features)
        self.compute_dtype = self.weight.dtype  # the dense dtype after any module-wide .to(dtype)
        self.weight = new_param(shape, torch.float8_e4m3fn, self.weight)
        self.scale = new_param(
            (-(-shape[0] // b0), -(-shape[1] // b1)), stored_torch_dtype(scale_dtype), self.weight
        )
        self.block = (b0, b1)

    @property
    def quantized(self) -> bool:
        return self.scale is not None

    @property
    def dtype(self) -> torch.dtype:
        """Compute dtype: the input is cast to it, the output is in it."""
        return self.weight.dtype if self.compute_dtype is None else self.compute_dtype

    def forward(self, x: Tensor) -> Tensor:
        x = x.to(self.dtype)
        if self.scale is None:
            return F.linear(x, self.weight)
        return fp8_linear(x, self.weight, self.scale, self.block, act_quant=self.quantize_activations,
                          backend=self.kernel_backend, counters=split_counters(self, x.device), pdl=self.pdl)

    def f32_out(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """``x Wᵀ`` as float32 over the dense weight in its own dtype (fp32 accumulation, W never widened): the LM
        head and the fp32 compressor projections. out: a contiguous float32 tensor to write it into."""
        return linear_f32_out(x, self.weight, backend=self.kernel_backend, counters=split_counters(self, x.device),
                              out=out)

    def grouped(self, x: Tensor, groups: int) -> Tensor:
        """Block-diagonal use of the weight: x ``[T, G, in/G]`` with row group g of W ``[G*r, in/G]`` -> ``[T, G, r]``
        (the grouped low-rank output projection)."""
        x = x.to(self.dtype)
        rows = self.out_features // groups
        if self.scale is None:
            return torch.einsum("tgi,gri->tgr", x, self.weight.view(groups, rows, -1))
        b0 = self.block[0]
        if rows % b0:  # a scale block straddles two groups: decode per call (small configs only)
            from deepinfer_kernels.quant import dequant_fp8_block

            w = dequant_fp8_block(self.weight, self.scale, self.block).to(self.dtype)
            if self.quantize_activations:
                from deepinfer_kernels.quant import fake_quant_act_fp8

                x = fake_quant_act_fp8(x, self.block[1]).to(self.dtype)
            return torch.einsum("tgi,gri->tgr", x, w.view(groups, rows, -1))
        return fp8_linear_grouped(x, self.weight, self.scale, self.block, act_quant=self.quantize_activations,
                                  backend=self.kernel_backend, counters=split_counters(self, x.device), pdl=self.pdl)
