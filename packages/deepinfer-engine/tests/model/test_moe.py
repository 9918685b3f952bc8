"""MoE gate wiring (docs/model.md §A.8, docs/model.md §C.5): hash layers route by the current token id without bias; V4.1
image-sentinel ids select with `bias_vl`; weights always from the unbiased scores; shared expert added."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.moe import MoE
from deepinfer_engine.model.presets import tiny_v4_config, tiny_v41_config
from deepinfer_kernels.moe import swiglu_expert
from equality import init_random_


def test_hash_layer_routes_by_token_id():
    a = ModelArgs.from_config_dict(tiny_v4_config())
    moe = init_random_(MoE(a, a.plan(0), torch.float32), seed=1)
    assert a.plan(0).is_hash_layer and moe.gate.bias is None
    ids = torch.tensor([5, 77, 5])
    x = torch.randn(3, a.hidden_size, generator=torch.Generator().manual_seed(0))
    w, sel = moe.gate(x, ids)
    assert torch.equal(sel, moe.gate.tid2eid[ids])
    scores = torch.sqrt(torch.nn.functional.softplus(x @ moe.gate.weight.T))
    want = scores.gather(1, sel)
    torch.testing.assert_close(w, want / want.sum(-1, keepdim=True) * a.routed_scaling_factor)
    # whole MoE = weighted routed experts + shared expert
    y = moe(x, ids)
    stacked = moe.experts.stacked()  # [E, ...] experts; stacked[e] decodes expert e (w1, w3, w2)
    ref = moe.shared_experts(x) + sum(
        w[:, k : k + 1]
        * torch.stack([swiglu_expert(x[t : t + 1], *stacked[int(e)], a.swiglu_limit)[0] for t, e in enumerate(sel[:, k])])
        for k in range(sel.shape[1])
    )
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-6)


def test_image_ids_select_with_bias_vl():
    a = ModelArgs.from_config_dict(tiny_v41_config())
    moe = init_random_(MoE(a, a.plan(3), torch.float32), seed=2)
    assert moe.gate.bias_vl is not None
    with torch.no_grad():
        moe.gate.bias.zero_()
        moe.gate.bias_vl.copy_(torch.tensor([0, 0, 0, 0, 0, 0, 100.0, 100.0]))  # image tokens forced to 6, 7
    x = torch.randn(3, a.hidden_size, generator=torch.Generator().manual_seed(1))
    v = a.vocab_size
    ids = torch.tensor([10, v, v + 4])  # image positions are ids past the vocabulary
    w, sel = moe.gate(x, ids)
    assert sorted(sel[1].tolist()) == [6, 7] and sorted(sel[2].tolist()) == [6, 7]
    # the config's image_token_id is an ordinary text id: it routes with `bias` like id 10
    _, sel_txt = moe.gate(x, torch.tensor([10, a.image_token_id, a.image_token_id + 4]))
    _, sel_ref = moe.gate(x, torch.tensor([10, 11, 12]))
    assert torch.equal(sel_txt, sel_ref)
    scores = torch.sqrt(torch.nn.functional.softplus(x @ moe.gate.weight.T))
    assert sorted(sel[0].tolist()) == sorted(torch.topk(scores[0], 2).indices.tolist())
    want = scores[1, sel[1]]
    torch.testing.assert_close(w[1], want / want.sum() * a.routed_scaling_factor)


def test_routed_experts_go_through_the_dispatch_strategy():
    """Default LocalDispatch = the local Experts call (bit for bit); an EPDispatch over a one-rank EP group
    (dispatch -> the layer's Experts on received rows -> combine) gives the same output (fp32, 1e-5)."""
    from deepinfer_parallel import EPDispatch, EPDispatcher, LocalDispatch, ParallelState

    a = ModelArgs.from_config_dict(tiny_v41_config())
    plan = a.plan(a.num_hash_layers)  # a score-routed layer
    moe = init_random_(MoE(a, plan, torch.float32), seed=3)
    assert isinstance(moe.dispatch, LocalDispatch)
    x = torch.randn(9, a.hidden_size, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(9)
    w, sel = moe.gate(x, ids)
    want = (moe.experts(x, w, sel) + moe.shared_experts(x).float()).to(x.dtype)
    local = moe(x, ids)
    assert torch.equal(local, want)
    disp = EPDispatcher(ParallelState.single(), num_physical_experts=plan.n_routed_experts,
                        hidden_size=a.hidden_size, top_k=plan.num_experts_per_tok, dtype=torch.float32)
    moe.dispatch = EPDispatch(disp)
    torch.testing.assert_close(moe(x, ids), local, atol=1e-5, rtol=1e-5)


def _fp4_experts(e: int, d: int, inter: int, g: torch.Generator) -> tuple[object, dict]:
    """Experts in the checkpoint FP4 format, every slot filled through its weight loader."""
    from deepinfer_engine.model.moe import Experts
    from deepinfer_kernels.quant import quant_fp4

    ex = Experts(e, d, inter, 10.0, torch.float32)
    ckpt = {}
    for name, (o, i) in (("w1", (inter, d)), ("w3", (inter, d)), ("w2", (d, inter))):
        w = getattr(ex, name)
        w.use_checkpoint_format("fp4_e2m1x2", "f8_e8m0", (1, 32))
        for slot in range(e):
            q, s = quant_fp4(torch.randn(o, i, generator=g) / i**0.5)
            w.weight.weight_loader(w.weight, q, slot)
            w.scale.weight_loader(w.scale, s, slot)
            ckpt[(name, slot)] = (q, s)
    return ex, ckpt


def test_chunked_expert_layout_in_place_slot_loads_and_moves():
    """The chunked layout (deepinfer_kernels.moe.fp4_layout) applied in place: the experts decode to the same
    weights and compute the same output; a later checkpoint load into a slot is repacked by the weight loader;
    an EPLB move (whole-slot copies) carries the experts along."""
    from deepinfer_engine.model.moe import chunk_model_experts
    from deepinfer_kernels.moe.fp4_layout import chunk_codes, chunk_scales

    g = torch.Generator().manual_seed(5)
    e, d, inter = 3, 256, 128
    ex, ckpt = _fp4_experts(e, d, inter, g)
    before = [ex.stacked()[i] for i in range(e)]
    x = torch.randn(4, d, generator=g)
    weights = torch.rand(4, 2, generator=g)
    ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2]])
    out = ex(x, weights, ids)
    assert chunk_model_experts(ex) == 0  # CPU experts keep the checkpoint layout
    assert ex.use_chunked_layout() and ex.w1.fmt == ex.w2.fmt == ex.w3.fmt == "fp4_chunked"
    st = ex.stacked()
    assert st.fmt == "fp4_chunked" and st.w1.data_ptr() == ex.w1.weight.data_ptr()  # in place
    assert not torch.equal(st.w1[0], ckpt[("w1", 0)][0])
    for i in range(e):
        for a, b in zip(st[i], before[i], strict=True):
            assert torch.equal(a, b)
    assert torch.equal(ex(x, weights, ids), out)
    q, s = ckpt[("w3", 1)]
    ex.w3.weight.data[1].zero_()
    ex.w3.weight.weight_loader(ex.w3.weight, q, 1)
    ex.w3.scale.weight_loader(ex.w3.scale, s, 1)
    assert torch.equal(ex.w3.weight[1], chunk_codes(q))
    assert torch.equal(ex.w3.scale[1].view(torch.uint8), chunk_scales(s).view(torch.uint8))
    # an EPLB move (single rank: a local permutation of whole slots) carries the chunked experts along
    from deepinfer_parallel.eplb.shuffle import move_expert_weights
    from deepinfer_parallel.state import ParallelState

    move_expert_weights(ex.tensors(), torch.tensor([0, 1, 2]), torch.tensor([2, 0, 0]), ParallelState.single())
    for slot, expert in enumerate((2, 0, 0)):
        for a, b in zip(ex.stacked()[slot], before[expert], strict=True):
            assert torch.equal(a, b)
    assert not ex.use_chunked_layout()  # already chunked: nothing to do


def test_chunked_expert_layout_needs_whole_chunks():
    from deepinfer_engine.errors import ModelConfigError

    ex, _ = _fp4_experts(2, 96, 128, torch.Generator().manual_seed(6))  # d = 96: no whole 128-column chunks
    assert not ex.use_chunked_layout() and ex.w1.fmt == "fp4"
    with pytest.raises(ModelConfigError, match="multiple of 128"):
        ex.w1.use_chunked_layout()


@pytest.mark.gpu
def test_chunk_model_experts_on_cuda_keeps_the_output():
    """On CUDA the repacked experts run the FP4 kernels on the chunked layout (tile kernels at T = 1, grouped ones
    from 48 pairs): the output stays within the kernels' bf16 tolerance of the torch reference (2e-2 of max |ref|,
    as deepinfer-kernels' FP4 tests), before and after the repack."""
    from deepinfer_engine.model.moe import chunk_model_experts
    from deepinfer_kernels.moe import moe_experts

    g = torch.Generator().manual_seed(7)
    ex, _ = _fp4_experts(8, 256, 384, g)
    ex = ex.cuda()
    for t in (1, 16):
        x = torch.randn(t, 256, generator=g).bfloat16().cuda()
        weights = torch.rand(t, 6, generator=g).cuda()
        ids = torch.stack([torch.randperm(8, generator=g)[:6] for _ in range(t)]).cuda()
        ref = moe_experts(x, weights, ids, ex.stacked(), ex.limit, backend="torch")
        scale = ref.abs().max()
        assert float((ex(x, weights, ids) - ref).abs().max() / scale) <= 2e-2
        if t == 1:
            assert chunk_model_experts(ex) == 1 and ex.stacked().fmt == "fp4_chunked"
        assert float((ex(x, weights, ids) - ref).abs().max() / scale) <= 2e-2
