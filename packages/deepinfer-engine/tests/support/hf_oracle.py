"""HF transformers oracle for the DeepSeek-V4-Flash backbone (test-only; `transformers` >= 5.23 is a dev dependency).

The official checkpoint names (docs/checkpoint.md §6.3, no ``model.`` prefix) are mapped to the parameter names of
``transformers.DeepseekV4ForCausalLM`` (checked against transformers 5.24: ``models/deepseek_v4/modeling_deepseek_v4.py``
and the ``"deepseek_v4"`` rules of ``conversion_mapping.py``), so a dequantized fp32 state dict of our model can run
through HF's eager reference. HF covers Part A only: no MTP / DSpark (``mtp.*`` is dropped) and no V4.1.
HF's indexer omits the reference's Hadamard / FP4 simulation, and HF runs no FP8 KV fake-quantization, which is also
what our bf16/fp32 reference path does.

Typical parity test::

    from hf_oracle import build_hf_model, hf_logits
    hf = build_hf_model(state, args)          # state: official name -> dequantized fp32 tensor
    ref = hf_logits(hf, input_ids)            # [T, V] float32, full causal prefill, no cache

``transformers`` is imported lazily inside the functions; importing this module costs nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from deepinfer_engine.errors import CheckpointError, ModelConfigError

__all__ = [
    "HF_IGNORED_PREFIXES",
    "build_hf_model",
    "canonical_tie_break",
    "hf_config_from_args",
    "hf_incremental_logits",
    "hf_indexer_boundary_ties",
    "hf_logits",
    "hf_reference_logits",
    "official_to_hf_name",
    "official_to_hf_state_dict",
    "random_official_v4_state",
    "v4_official_shapes",
    "v4_official_shapes_from_spec",
]

HF_IGNORED_PREFIXES = ("mtp.",)
"""Official tensors HF has no module for (DeepseekV4PreTrainedModel ignores ``mtp.*`` on load)."""

_GLOBAL_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}

# Per-layer official suffix -> HF suffix (under ``model.layers.{l}.``). Experts are handled separately because
# HF stacks them into 3-D parameters.
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.attn_sink": "self_attn.sinks",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    # HF nests the CSA indexer inside the CSA compressor; the scorer owns weights_proj.
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}

_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def official_to_hf_name(name: str) -> str | None:
    """HF parameter name of one official non-expert tensor; ``None`` for tensors HF ignores (``mtp.*``).

    Routed-expert tensors (``layers.l.ffn.experts.e.w{1,2,3}.weight``) have no 1:1 name (HF stacks them into
    ``mlp.experts.gate_up_proj`` / ``down_proj``) and raise; use `official_to_hf_state_dict`.
    """
    if name.startswith(HF_IGNORED_PREFIXES):
        return None
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _LAYER_RE.match(name)
    if m is not None:
        layer, rest = m.group(1), m.group(2)
        if rest in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
    if name.endswith(".scale"):  # FP8/FP4 companions; hc_*_scale names have no dot before "scale"
        raise CheckpointError(
            f"tensor {name!r}: found a quantization scale, expected dequantized weights only "
            "(load with CheckpointReader.load, which folds the scale into the weight)"
        )
    raise CheckpointError(
        f"tensor {name!r}: found no HF DeepseekV4 equivalent, expected an official V4 name (§6.3)"
    )


def official_to_hf_state_dict(state: Mapping[str, torch.Tensor], args: Any) -> dict[str, torch.Tensor]:
    """Map an official-name state dict (dequantized; fp32 expected) to ``DeepseekV4ForCausalLM`` names.

    Routed experts of layer l: ``gate_up_proj [E, 2I, d] = cat(stack(w1), stack(w3), dim=1)`` (gate rows first,
    HF's ``_apply_gate`` chunks gate|up) and ``down_proj [E, d, I] = stack(w2)``. Every expert 0..E-1 of every
    layer that has any must be present. ``mtp.*`` is dropped. Tensors are not copied where HF's layout equals
    the official one.
    """
    n_experts = int(args.n_routed_experts)
    out: dict[str, torch.Tensor] = {}
    experts: dict[int, dict[str, dict[int, torch.Tensor]]] = {}
    for name, tensor in state.items():
        m = _LAYER_RE.match(name)
        if m is not None:
            em = _EXPERT_RE.match(m.group(2))
            if em is not None:
                per = experts.setdefault(int(m.group(1)), {"w1": {}, "w2": {}, "w3": {}})
                per[em.group(2)][int(em.group(1))] = tensor
                continue
        hf_name = official_to_hf_name(name)
        if hf_name is not None:
            out[hf_name] = tensor
    for layer, per in sorted(experts.items()):
        for w in ("w1", "w2", "w3"):
            got = sorted(per[w])
            if got != list(range(n_experts)):
                missing = sorted(set(range(n_experts)) - set(got))
                raise CheckpointError(
                    f"tensor layers.{layer}.ffn.experts.*.{w}.weight: found experts {got[:8]}... "
                    f"(missing {missing[:8]}), expected 0..{n_experts - 1} (n_routed_experts)"
                )
        w1 = torch.stack([per["w1"][e] for e in range(n_experts)])  # [E, I, d]
        w3 = torch.stack([per["w3"][e] for e in range(n_experts)])  # [E, I, d]
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.cat([w1, w3], dim=1)  # [E, 2I, d]
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack(
            [per["w2"][e] for e in range(n_experts)]
        )  # [E, d, I]
    return out


def _hf_layer_types(args: Any) -> tuple[list[str], dict[str, int]]:
    """HF ``layer_types`` + ``compress_rates`` for the backbone layers (HF maps only 0/4/128 from ratios)."""
    ratios = list(args.compress_ratios[: args.num_hidden_layers])
    types: list[str] = []
    hca_rates = set()
    for layer, r in enumerate(ratios):
        if r == 0:
            types.append("sliding_attention")
        elif r == 4:
            types.append("compressed_sparse_attention")
        elif r > 0:
            types.append("heavily_compressed_attention")
            hca_rates.add(r)
        else:
            raise ModelConfigError(
                f"compress_ratios[{layer}]: found {r}, expected 0, 4 or a positive HCA ratio"
            )
    if len(hca_rates) > 1:
        raise ModelConfigError(
            f"compress_ratios: found HCA ratios {sorted(hca_rates)}, expected one HCA ratio "
            "(HF DeepseekV4Config has a single compress_rates['heavily_compressed_attention'])"
        )
    rates = {
        "compressed_sparse_attention": 4,
        "heavily_compressed_attention": hca_rates.pop() if hca_rates else 128,
    }
    return types, rates


def hf_config_from_args(args: Any) -> Any:
    """``transformers.DeepseekV4Config`` equivalent to a V4 ``ModelArgs`` (backbone only; MTP not built by HF).

    Eager attention and eager experts (the reference loops), fp32 compute by the caller's choice of dtype.
    """
    if getattr(args, "arch", "v4") != "v4":
        raise ModelConfigError(f"arch: found {args.arch!r}, expected 'v4' (HF has no DeepSeek-V4.1 model)")
    from transformers import DeepseekV4Config

    layer_types, compress_rates = _hf_layer_types(args)
    n_hash = int(args.num_hash_layers)
    mlp_layer_types = ["hash_moe"] * n_hash + ["moe"] * (args.num_hidden_layers - n_hash)
    rope: dict[str, Any] = {"rope_type": "default"}
    rs = args.rope_scaling
    if rs is not None:
        rope = {
            "rope_type": "yarn",
            "factor": float(rs.factor),
            "beta_fast": float(rs.beta_fast),
            "beta_slow": float(rs.beta_slow),
            "original_max_position_embeddings": int(rs.original_max_position_embeddings),
        }
    cfg = DeepseekV4Config(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        moe_intermediate_size=args.moe_intermediate_size,
        num_hidden_layers=args.num_hidden_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
        q_lora_rank=args.q_lora_rank,
        num_experts_per_tok=args.num_experts_per_tok,
        n_routed_experts=args.n_routed_experts,
        n_shared_experts=args.n_shared_experts,
        scoring_func=args.scoring_func,
        norm_topk_prob=args.norm_topk_prob,
        routed_scaling_factor=float(args.routed_scaling_factor),
        max_position_embeddings=args.max_position_embeddings,
        rope_theta=float(args.rope_theta),
        layer_types=layer_types,
        compress_rates=compress_rates,
        compress_rope_theta=float(args.compress_rope_theta),
        hc_mult=args.hc_mult,
        hc_sinkhorn_iters=args.hc_sinkhorn_iters,
        hc_eps=float(args.hc_eps),
        mlp_layer_types=mlp_layer_types,
        swiglu_limit=float(args.swiglu_limit),
        sliding_window=args.sliding_window,
        o_groups=args.o_groups,
        o_lora_rank=args.o_lora_rank,
        index_n_heads=args.index_n_heads,
        index_head_dim=args.index_head_dim,
        index_topk=args.index_topk,
        num_nextn_predict_layers=args.num_nextn_predict_layers,
        hidden_act=args.hidden_act,
        rms_norm_eps=float(args.rms_norm_eps),
        bos_token_id=args.bos_token_id,
        eos_token_id=args.eos_token_id,
        tie_word_embeddings=bool(args.tie_word_embeddings),
        rope_parameters=rope,
        partial_rotary_factor=args.qk_rope_head_dim / args.head_dim,
        attn_implementation="eager",
        experts_implementation="eager",
    )
    return cfg


def build_hf_model(
    state: Mapping[str, torch.Tensor],
    args: Any,
    *,
    dtype: torch.dtype = torch.float32,
    canonical_topk_ties: bool = True,
) -> Any:
    """``DeepseekV4ForCausalLM`` in eval mode holding ``state`` (official names), loaded strictly.

    Raises `CheckpointError` naming the missing / unexpected HF keys if the mapped state does not cover the HF
    model exactly (non-persistent RoPE buffers excepted).

    ``canonical_topk_ties``: HF selects the CSA top-k with ``torch.topk``, whose order among EXACTLY equal scores
    is unspecified (the reference uses torch.topk too); our indexer kernel takes the lower entry id first.
    Exact ties are common with tiny random weights (score = sum_h w_h * ReLU(q_h . k) is exactly 0 whenever
    every head's dot product is <= 0; index_n_heads = 4 in tiny V4). With this flag a forward hook on each
    indexer scorer breaks exact ties toward the lower entry id without reordering distinct fp32 scores, so
    both models select the same set (see `canonical_tie_break`). Selection is the only use of these scores.
    """
    from transformers import DeepseekV4ForCausalLM

    cfg = hf_config_from_args(args)
    hf_state = official_to_hf_state_dict(state, args)
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - set(hf_state))
    unexpected = sorted(set(hf_state) - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"HF DeepseekV4ForCausalLM state: found {len(missing)} missing keys {missing[:6]} and "
            f"{len(unexpected)} unexpected keys {unexpected[:6]}, expected an exact match"
        )
    casted = {k: (v.to(dtype) if v.is_floating_point() else v) for k, v in hf_state.items()}
    model.load_state_dict(casted, strict=True, assign=True)
    # RoPE inverse frequencies are non-persistent buffers: rebuild them on CPU (they were created on meta).
    _rebuild_rotary_buffers(model, cfg)
    if canonical_topk_ties:
        for module in _indexer_scorers(model).values():
            module.register_forward_hook(lambda _m, _inp, out: canonical_tie_break(out))
    model.eval()
    return model


def canonical_tie_break(scores: torch.Tensor) -> torch.Tensor:
    """``scores [..., N]`` (fp32) -> float64 scores whose descending order is the stable one (ties: lower index).

    Distinct fp32 values differ by at least 2**-24 relative; the perturbation is at most N * 2**-40 relative
    (plus 1e-300 per index, which only separates exact zeros), so for N < 2**16 no order between distinct values
    changes. -inf stays -inf.
    """
    s = scores.double()
    idx = torch.arange(s.shape[-1], dtype=torch.float64, device=s.device)
    pert = idx * (s.abs().nan_to_num(posinf=0.0) * 2.0**-40 + 1e-300)
    return s - pert


def _indexer_scorers(model: Any) -> dict[int, Any]:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

    out: dict[int, Any] = {}
    for layer_idx, layer in enumerate(model.model.layers):
        for module in layer.modules():
            if isinstance(module, DeepseekV4IndexerScorer):
                out[layer_idx] = module
    return out


@torch.no_grad()
def hf_indexer_boundary_ties(model: Any, input_ids: torch.Tensor | Sequence[int]) -> list[tuple[int, int]]:
    """(layer, position) pairs where HF's raw CSA index scores tie EXACTLY at the top-k boundary.

    At such a query the selected set is implementation-defined (k-th and (k+1)-th best visible scores equal).
    Diagnostic for parity failures; hooks are removed afterwards.
    """
    scorers = _indexer_scorers(model)
    captured: dict[int, torch.Tensor] = {}
    handles = []
    for layer_idx, module in scorers.items():
        # registered first, so it sees the raw scores (before any canonical_tie_break hook rewrites them)
        handles.append(
            module.register_forward_hook(
                lambda _m, _inp, out, i=layer_idx: captured.__setitem__(i, out[0].detach().clone()),
                prepend=True,
            )
        )
    try:
        hf_logits(model, input_ids)
    finally:
        for h in handles:
            h.remove()
    ratio = model.config.compress_rates["compressed_sparse_attention"]
    k_max = model.config.index_topk
    ties: list[tuple[int, int]] = []
    for layer_idx, scores in sorted(captured.items()):
        for t in range(scores.shape[0]):
            visible = min((t + 1) // ratio, scores.shape[1])
            k = min(k_max, visible)
            if visible > k:
                v = scores[t, :visible].sort(descending=True).values
                if v[k - 1] == v[k]:
                    ties.append((layer_idx, t))
    return ties


def _rebuild_rotary_buffers(model: Any, cfg: Any) -> None:
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    for name, module in list(model.named_modules()):
        if isinstance(module, DeepseekV4RotaryEmbedding):
            fresh = DeepseekV4RotaryEmbedding(cfg, device="cpu")
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, fresh)


@torch.no_grad()
def hf_logits(model: Any, input_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    """Full causal prefill of one sequence without a cache: ``[T, V] float32`` logits."""
    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    out = model(input_ids=ids, use_cache=False)
    return out.logits[0].float()


@torch.no_grad()
def hf_incremental_logits(
    model: Any, input_ids: torch.Tensor | Sequence[int], chunks: Sequence[int]
) -> torch.Tensor:
    """Same sequence fed as consecutive chunks through HF's DynamicCache: ``[T, V] float32``."""
    from transformers import DynamicCache

    ids = torch.as_tensor(input_ids, dtype=torch.long).reshape(1, -1)
    if sum(chunks) != ids.shape[1] or min(chunks, default=1) < 1:
        raise ModelConfigError(
            f"chunks: found {list(chunks)} (sum {sum(chunks)}), expected positive sizes summing to {ids.shape[1]}"
        )
    cache = DynamicCache(config=model.config)
    outs, pos = [], 0
    for n in chunks:
        piece = ids[:, pos : pos + n]
        positions = torch.arange(pos, pos + n).reshape(1, -1)
        out = model(input_ids=piece, position_ids=positions, cache=cache, use_cache=True)
        outs.append(out.logits[0].float())
        pos += n
    return torch.cat(outs)


def hf_reference_logits(
    state: Mapping[str, torch.Tensor], args: Any, input_ids: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """One-shot oracle: build HF from ``state`` (official names, dequantized) and return ``[T, V] float32``.

    Builds the model on every call; use `build_hf_model` + `hf_logits` for several sequences.
    """
    return hf_logits(build_hf_model(state, args), input_ids)


# ----------------------------------------------------------------------------------------------------------
# Random official-name states for oracle tests
# ----------------------------------------------------------------------------------------------------------


def v4_official_shapes_from_spec(args: Any) -> dict[str, tuple[int, ...]]:
    """Official V4 backbone tensor names -> logical shapes, from docs/checkpoint.md §6.3 (MTP included)."""
    d, hc = args.hidden_size, args.hc_mult
    H, Dh, Rq = args.num_attention_heads, args.head_dim, args.q_lora_rank
    G, Ro, E, I = args.o_groups, args.o_lora_rank, args.n_routed_experts, args.moe_intermediate_size
    nI, dI, V = args.index_n_heads, args.index_head_dim, args.vocab_size
    mix = (2 + hc) * hc
    out: dict[str, tuple[int, ...]] = {
        "embed.weight": (V, d),
        "head.weight": (V, d),
        "norm.weight": (d,),
        "hc_head_fn": (hc, hc * d),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    n_layers = len(args.compress_ratios)  # backbone + MTP
    for l in range(n_layers):
        ratio = args.compress_ratios[l]
        is_mtp = l >= args.num_hidden_layers
        p = f"mtp.{l - args.num_hidden_layers}." if is_mtp else f"layers.{l}."
        out |= {
            p + "attn_norm.weight": (d,),
            p + "ffn_norm.weight": (d,),
            p + "hc_attn_fn": (mix, hc * d),
            p + "hc_ffn_fn": (mix, hc * d),
            p + "hc_attn_base": (mix,),
            p + "hc_ffn_base": (mix,),
            p + "hc_attn_scale": (3,),
            p + "hc_ffn_scale": (3,),
            p + "attn.attn_sink": (H,),
            p + "attn.q_norm.weight": (Rq,),
            p + "attn.kv_norm.weight": (Dh,),
            p + "attn.wq_a.weight": (Rq, d),
            p + "attn.wq_b.weight": (H * Dh, Rq),
            p + "attn.wkv.weight": (Dh, d),
            p + "attn.wo_a.weight": (G * Ro, H * Dh // G),
            p + "attn.wo_b.weight": (d, G * Ro),
            p + "ffn.gate.weight": (E, d),
            p + "ffn.shared_experts.w1.weight": (I, d),
            p + "ffn.shared_experts.w3.weight": (I, d),
            p + "ffn.shared_experts.w2.weight": (d, I),
        }
        if ratio > 0:
            width = 2 * Dh if ratio == 4 else Dh  # CSA overlap doubles the compressor width
            out |= {
                p + "attn.compressor.wkv.weight": (width, d),
                p + "attn.compressor.wgate.weight": (width, d),
                p + "attn.compressor.ape": (ratio, width),
                p + "attn.compressor.norm.weight": (Dh,),
            }
        if ratio == 4:
            out |= {
                p + "attn.indexer.wq_b.weight": (nI * dI, Rq),
                p + "attn.indexer.weights_proj.weight": (nI, d),
                p + "attn.indexer.compressor.wkv.weight": (2 * dI, d),
                p + "attn.indexer.compressor.wgate.weight": (2 * dI, d),
                p + "attn.indexer.compressor.ape": (ratio, 2 * dI),
                p + "attn.indexer.compressor.norm.weight": (dI,),
            }
        if not is_mtp and l < args.num_hash_layers:
            out[p + "ffn.gate.tid2eid"] = (V, args.num_experts_per_tok)
        else:
            out[p + "ffn.gate.bias"] = (E,)
        for e in range(E):
            out |= {
                p + f"ffn.experts.{e}.w1.weight": (I, d),
                p + f"ffn.experts.{e}.w3.weight": (I, d),
                p + f"ffn.experts.{e}.w2.weight": (d, I),
            }
        if is_mtp:
            out |= {
                p + "e_proj.weight": (d, d),
                p + "h_proj.weight": (d, d),
                p + "enorm.weight": (d,),
                p + "hnorm.weight": (d,),
                p + "norm.weight": (d,),
                p + "hc_head_fn": (hc, hc * d),
                p + "hc_head_base": (hc,),
                p + "hc_head_scale": (1,),
            }
    return out


def v4_official_shapes(args: Any) -> dict[str, tuple[int, ...]]:
    """The tensor inventory when it exists (official names, logical shapes), else the §6.3 list above."""
    try:
        from deepinfer_engine.model.inventory import tensor_inventory
    except ImportError:
        return v4_official_shapes_from_spec(args)
    return {t.name: tuple(t.shape) for t in tensor_inventory(args) if not t.name.endswith(".scale")}


def random_official_v4_state(args: Any, seed: int) -> dict[str, torch.Tensor]:
    """Random fp32 official-name state with well-conditioned magnitudes (non-zero ape, sinks, biases)."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in sorted(v4_official_shapes(args).items()):
        if name.endswith("tid2eid"):
            out[name] = torch.randint(0, args.n_routed_experts, shape, generator=g, dtype=torch.int64)
            continue
        if name.endswith(("norm.weight",)):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif name.endswith(("_fn",)):
            t = 0.05 * torch.randn(shape, generator=g)
        elif name.endswith(("_base", "ape", "gate.bias")):
            t = 0.5 * torch.randn(shape, generator=g)
        elif name.endswith("_scale"):
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith("attn_sink"):
            t = torch.randn(shape, generator=g)
        elif name == "embed.weight":
            t = torch.randn(shape, generator=g)
        else:  # [out, in] linear: unit-variance outputs
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        out[name] = t.float()
    return out
