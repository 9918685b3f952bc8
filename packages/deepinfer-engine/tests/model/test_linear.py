"""model/linear.py: a Linear holding its FP8 checkpoint format computes exactly what the dense Linear with the
decoded weight computes (fp32), grouped use included; activation quantization; weight loaders; the inventory-driven
format switch refuses a quantized tensor in a module that cannot hold it."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.errors import CheckpointError, ModelConfigError
from deepinfer_engine.model.linear import Linear, default_weight_loader, stacked_weight_loader
from deepinfer_engine.model.weight_formats import apply_checkpoint_formats, resident_bytes
from deepinfer_engine.model.weight_names import checkpoint_to_param, param_to_checkpoint
from deepinfer_kernels.quant import dequant_fp8_block, fake_quant_act_fp8, quant_fp8_block
from torch import nn


def _pair(out_f: int, in_f: int, block: tuple[int, int], seed: int = 0) -> tuple[Linear, Linear]:
    g = torch.Generator().manual_seed(seed)
    q, s = quant_fp8_block(torch.randn(out_f, in_f, generator=g) / in_f**0.5, block)
    dense = Linear(in_f, out_f, torch.float32)
    dense.weight.data.copy_(dequant_fp8_block(q, s, block))
    quant = Linear(in_f, out_f, torch.float32)
    quant.use_checkpoint_format("f8_e4m3", "f8_e8m0", block)
    quant.weight.data.copy_(q)
    quant.scale.data.copy_(s)
    return dense, quant


def test_fp8_linear_equals_dense_decoded_linear():
    dense, quant = _pair(48, 64, (32, 32))
    assert (
        quant.weight.dtype == torch.float8_e4m3fn
        and quant.scale.shape == (2, 2)
        and quant.dtype == torch.float32
    )
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    assert torch.equal(quant(x), dense(x))
    quant.quantize_activations = True
    assert torch.equal(quant(x), dense(fake_quant_act_fp8(x, 32)))


@pytest.mark.parametrize(
    ("rows", "block"), [(32, (32, 32)), (16, (32, 32))]
)  # whole / straddling scale blocks
def test_grouped_equals_dense(rows, block):
    groups = 4
    dense, quant = _pair(groups * rows, 32, block, seed=2)
    x = torch.randn(3, groups, 32, generator=torch.Generator().manual_seed(3))
    assert torch.equal(quant.grouped(x, groups), dense.grouped(x, groups))


def test_weight_loaders_check_shapes_and_slots():
    p = torch.zeros(3, 2, 4)
    stacked_weight_loader(p, torch.ones(2, 4), 1)
    assert p[1].sum() == 8 and p[0].sum() == 0
    with pytest.raises(CheckpointError, match="out of range"):
        stacked_weight_loader(p, torch.ones(2, 4), 3)
    with pytest.raises(CheckpointError, match=r"\[2, 5\], expected \[2, 4\]"):
        stacked_weight_loader(p, torch.ones(2, 5), 0)
    with pytest.raises(CheckpointError, match="not stacked"):
        default_weight_loader(torch.zeros(2), torch.ones(2), 0)


def test_name_table_round_trip():
    assert checkpoint_to_param("layers.3.ffn.experts.17.w2.scale") == ("layers.3.ffn.experts.w2.scale", 17)
    assert checkpoint_to_param("layers.3.ffn.shared_experts.w2.weight") == (
        "layers.3.ffn.shared_experts.w2.weight",
        None,
    )
    names = param_to_checkpoint("mtp.0.ffn.experts.w1.weight", 3)
    assert names == [(f"mtp.0.ffn.experts.{e}.w1.weight", e) for e in range(3)]


def test_format_switch_refuses_a_module_that_cannot_hold_it():
    from deepinfer_engine.model.args import ModelArgs
    from deepinfer_engine.model.model import Transformer
    from deepinfer_engine.model.presets import tiny_v4_config

    a = ModelArgs.from_config_dict(tiny_v4_config())
    with torch.device("meta"):
        m = Transformer(a, torch.bfloat16)
    m.layers[0].attn.wq_a = nn.Identity()  # no use_checkpoint_format
    with pytest.raises(ModelConfigError, match=r"layers\.0\.attn\.wq_a\.weight.*cannot hold"):
        apply_checkpoint_formats(m, a)
    with torch.device("meta"):
        q = Transformer(a, torch.bfloat16, quantized=True, quantize_activations=True)
    by = resident_bytes(q)
    assert by["float8_e4m3fn"] > 0 and by["int8"] > 0 and q.layers[0].attn.wq_a.quantize_activations
    with pytest.raises(ModelConfigError, match="quantize_activations needs quantized"):
        Transformer(a, torch.bfloat16, quantize_activations=True)
