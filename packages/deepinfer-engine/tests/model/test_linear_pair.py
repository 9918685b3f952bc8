"""model/linear_pair.py: two FP8 Linears fused into one weight buffer compute, in one GEMM, exactly what the two
separate calls compute (bit-identical: torch reference and Triton interpreter, bf16 and fp32 activations, with and
without activation quantization); pairs that cannot be fused (N1 not on a scale block, dense, other formats) fall
back to two calls; parameter names / shapes / dtypes and the weight loaders are unchanged; a loaded tiny V4.1
model is fused and gives the same logits as its unfused copy."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_engine.model.linear import Linear, default_weight_loader
from deepinfer_engine.model.linear_pair import (
    dense_joint_weight,
    fuse_model_pairs,
    fuse_same_input,
    joint_weight,
    linear_pair,
)
from deepinfer_kernels.quant import quant_fp8_block
from torch import nn

pytestmark = pytest.mark.usefixtures("one_thread")


def _fp8(in_f: int, out_f: int, dtype: torch.dtype, block=(32, 32), seed: int = 0, scale: str = "f8_e8m0") -> Linear:
    g = torch.Generator().manual_seed(seed)
    q, s = quant_fp8_block(torch.randn(out_f, in_f, generator=g) / in_f**0.5, block)
    lin = Linear(in_f, out_f, dtype)
    lin.use_checkpoint_format("f8_e4m3", scale, block)
    lin.weight.data.copy_(q)
    lin.scale.data.copy_(s.float() if scale == "f32" else s)
    return lin


def _unfused(a: Linear) -> None:
    """Give `a` private copies of its parameters (what an unfused Linear holds)."""
    a.weight = nn.Parameter(a.weight.detach().clone(), requires_grad=False)
    a.scale = nn.Parameter(a.scale.detach().clone(), requires_grad=False)


@pytest.mark.parametrize("scale", ["f8_e8m0", "f32"])
@pytest.mark.parametrize("act_quant", [False, True], ids=["w8", "w8a8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fused_pair_equals_two_calls_torch(dtype, act_quant, scale):
    a, b = _fp8(64, 96, dtype, seed=1, scale=scale), _fp8(64, 40, dtype, seed=2, scale=scale)
    for m in (a, b):
        m.kernel_backend = "torch"
        m.quantize_activations = act_quant
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    ref = (a(x), b(x))
    wa, wb = a.weight.clone(), b.weight.clone()
    assert fuse_same_input(a, b) and joint_weight(a, b) is not None
    assert torch.equal(a.weight, wa) and torch.equal(b.weight, wb)
    ya, yb = linear_pair(x, a, b)
    assert ya.dtype == yb.dtype == dtype and ya.shape == (5, 96) and yb.shape == (5, 40)
    assert torch.equal(ya, ref[0]) and torch.equal(yb, ref[1])
    # a fused Linear called alone still computes its own rows
    assert torch.equal(a(x), ref[0]) and torch.equal(b(x), ref[1])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_fused_pair_equals_two_calls_triton_interpreter(dtype):
    from kernels_testing import LINEAR_MODULES, triton_interpreter

    a, b = _fp8(64, 64, dtype, seed=4), _fp8(64, 32, dtype, seed=5)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    with triton_interpreter(*LINEAR_MODULES):
        for m in (a, b):
            m.kernel_backend = "triton"
        ref = (a(x), b(x))
        assert fuse_same_input(a, b)
        ya, yb = linear_pair(x, a, b)
    assert torch.equal(ya, ref[0]) and torch.equal(yb, ref[1])


def test_one_buffer_same_names_and_loaders_write_through():
    a, b = _fp8(64, 64, torch.float32, seed=7), _fp8(64, 32, torch.float32, seed=8)
    owner = nn.Module()
    owner.wq_a, owner.wkv = a, b
    before = {k: (v.shape, v.dtype) for k, v in owner.state_dict().items()}
    assert fuse_same_input(a, b)
    assert {k: (v.shape, v.dtype) for k, v in owner.state_dict().items()} == before
    assert a.weight.untyped_storage().data_ptr() == b.weight.untyped_storage().data_ptr()
    assert b.weight.storage_offset() == a.weight.numel()
    assert fuse_same_input(a, b)  # already fused: nothing copied again
    assert b.weight.storage_offset() == a.weight.numel()
    # a reload through the weight loader lands in the joint buffer the fused GEMM reads
    new = _fp8(64, 32, torch.float32, seed=9)
    default_weight_loader(b.weight, new.weight)
    default_weight_loader(b.scale, new.scale)
    w, s = joint_weight(a, b)
    assert torch.equal(w[64:].view(torch.uint8), new.weight.view(torch.uint8))
    x = torch.randn(2, 64)
    assert torch.equal(linear_pair(x, a, b)[1], new(x))


def test_fallback_two_calls_when_not_fusable():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(10))
    # N1 = 48 is not a multiple of the 32-row scale block: a scale row would straddle the two weights
    a, b = _fp8(64, 48, torch.float32, seed=11), _fp8(64, 32, torch.float32, seed=12)
    pa = a.weight
    assert not fuse_same_input(a, b) and a.weight is pa and joint_weight(a, b) is None
    ya, yb = linear_pair(x, a, b)
    assert torch.equal(ya, a(x)) and torch.equal(yb, b(x))
    # dense Linears and mixed formats
    d1, d2 = Linear(64, 32, torch.float32), Linear(64, 16, torch.float32)
    nn.init.normal_(d1.weight)
    nn.init.normal_(d2.weight)
    assert not fuse_same_input(d1, d2)
    ya, yb = linear_pair(x, d1, d2)
    assert torch.equal(ya, d1(x)) and torch.equal(yb, d2(x))
    q = _fp8(64, 32, torch.float32, seed=13)
    assert not fuse_same_input(q, d2) and not fuse_same_input(q, _fp8(64, 32, torch.float32, block=(32, 64)))
    # other activation numerics: not one GEMM
    c = _fp8(64, 32, torch.float32, seed=14)
    c.quantize_activations = True
    assert not fuse_same_input(q, c)


def test_replaced_parameter_unfuses():
    a, b = _fp8(64, 64, torch.float32, seed=15), _fp8(64, 32, torch.float32, seed=16)
    assert fuse_same_input(a, b)
    _unfused(a)
    assert joint_weight(a, b) is None
    x = torch.randn(2, 64)
    ya, yb = linear_pair(x, a, b)
    assert torch.equal(ya, a(x)) and torch.equal(yb, b(x))


def test_loaded_tiny_v41_is_fused_and_equals_unfused(tiny_ckpt):
    from deepinfer_engine.model.cache import ModelCache
    from deepinfer_engine.model.forward_batch import ForwardBatch
    from deepinfer_engine.model.loader import load_model

    model = load_model(tiny_ckpt("v41"), dtype=torch.float32, with_draft=False)
    model.set_kernel_backend("torch")
    pairs = [(layer.attn.wq_a, layer.attn.wkv) for layer in model.layers]
    pairs += [(layer.ffn.shared_experts.w1, layer.ffn.shared_experts.w3) for layer in model.layers]
    assert all(joint_weight(a, b) is not None for a, b in pairs)
    ids = torch.randint(0, model.args.vocab_size, (9,), generator=torch.Generator().manual_seed(17))

    def logits() -> torch.Tensor:
        cache, bt = ModelCache.allocate_dense(model.args, [9], dtype=torch.float32)
        return model(ForwardBatch.single(ids, block_table=bt[0]), cache)

    # the ratio-2 CSA2 compressors' dense wkv + wgate (one projection launch, no stack)
    dense = [(layer.attn.compressor.wkv, layer.attn.compressor.wgate) for layer in model.layers
             if layer.attn.compressor is not None and getattr(layer.attn.compressor, "wgate", None) is not None]
    assert dense and all(dense_joint_weight(a, b) is not None for a, b in dense)
    fused = logits()
    for a, _ in pairs:
        _unfused(a)
    for a, _ in dense:
        a.weight = nn.Parameter(a.weight.detach().clone(), requires_grad=False)
    assert all(joint_weight(a, b) is None for a, b in pairs)
    assert all(dense_joint_weight(a, b) is None for a, b in dense)
    torch.testing.assert_close(fused, logits(), atol=0, rtol=1e-6)  # dense: one fp32 GEMM over N1 + N2 columns
    assert fuse_model_pairs(model) == len(pairs) + len(dense)
    assert torch.equal(fused, logits())


def test_dense_pair_one_buffer_stacked_projection():
    """Csa2Compressor.project_stacked: one GEMM over the fused [wkv; wgate] gives stack(A, Z) (fp32 GEMM over the
    joint columns: equal up to fp32 summation order, 1e-6); names, shapes and write-through loads unchanged."""
    from deepinfer_engine.model.csa2 import Csa2Compressor
    from deepinfer_engine.model.linear_pair import fuse_dense_pair

    g = torch.Generator().manual_seed(5)
    comp = Csa2Compressor(dim=64, head_dim=16, ratio=2, eps=1e-6).to(torch.bfloat16)
    for p in comp.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    x = torch.randn(5, 64, generator=g).bfloat16()
    a, z = comp.project(x)
    want = comp.project_stacked(x)
    assert torch.equal(want, torch.stack([a, z], 1))
    names = {k: (v.shape, v.dtype) for k, v in comp.state_dict().items()}
    assert fuse_dense_pair(comp.wkv, comp.wgate) and dense_joint_weight(comp.wkv, comp.wgate) is not None
    assert {k: (v.shape, v.dtype) for k, v in comp.state_dict().items()} == names
    torch.testing.assert_close(comp.project_stacked(x), want, atol=0, rtol=1e-6)
    new = torch.randn(16, 64, generator=g).bfloat16()
    default_weight_loader(comp.wgate.weight, new)  # a load writes into the joint buffer
    assert torch.equal(dense_joint_weight(comp.wkv, comp.wgate)[16:], new)
    assert Csa2Compressor(dim=64, head_dim=16, ratio=1, eps=1e-6).same_input_dense() == ()


@pytest.mark.gpu
def test_cuda_fused_pair_close_to_two_calls_and_graph_capturable():
    # the CUDA launch config follows N1 + N2 (split-K count): equal up to the fp32 summation order over K, i.e.
    # within one bf16 rounding step of the separate calls
    dev = torch.device("cuda")
    a = _fp8(1024, 256, torch.bfloat16, seed=18).to(dev)
    b = _fp8(1024, 128, torch.bfloat16, seed=19).to(dev)
    x = torch.randn(4, 1024, device=dev).to(torch.bfloat16)
    ref = (a(x), b(x))
    assert fuse_same_input(a, b)
    ya, yb = linear_pair(x, a, b)
    torch.testing.assert_close(ya, ref[0], atol=1e-3, rtol=2.0**-7)
    torch.testing.assert_close(yb, ref[1], atol=1e-3, rtol=2.0**-7)
    from deepinfer_engine.model.linear import split_counters

    assert int(split_counters(a, dev).abs().sum()) == 0  # every launch leaves its split-K counters at zero
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        ga, gb = linear_pair(x, a, b)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(ga, ya) and torch.equal(gb, yb)
