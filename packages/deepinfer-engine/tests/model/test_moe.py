"""MoE gate wiring (docs/model.md §A.8, docs/model.md §C.5): hash layers route by the current token id without bias; V4.1
image-sentinel ids select with `bias_vl`; weights always from the unbiased scores; shared expert added."""

from __future__ import annotations

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
