"""Writer of random checkpoints in exactly the official release format (docs/checkpoint.md §6).

`make_checkpoint(out_dir, arch, preset, seed)` writes config.json, generation_config.json,
model.safetensors.index.json, shards `model-0000K-of-0000N.safetensors` (safetensors format, no pickle),
tokenizer.json and tokenizer_config.json. Weights are random but scaled so activations stay O(1) through every
layer (linears ~ N(0, 1/fan_in), norms ~ 1, small mHC / sink / bias values), then quantized the way the release
stores them (FP8 e4m3 with power-of-two UE8M0 block scales, FP4 e2m1 experts with 1x32 E8M0 scales).
Generation is streamed shard by shard, so `layers-N` / `full` presets never hold more than one shard in memory.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from deepinfer_kernels.quant import E2M1_VALUES, float_to_e8m0, quant_fp4, quant_fp8_block

from deepinfer_engine.errors import CheckpointError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.checkpoint import INDEX_FILE
from deepinfer_engine.model.inventory import TensorSpec, tensor_inventory
from deepinfer_engine.model.presets import preset_config
from deepinfer_engine.model.tokenizer_files import write_tokenizer_files

__all__ = ["init_tensor", "make_checkpoint", "write_checkpoint"]

# Above this many logical values an FP4 expert is drawn directly as random e2m1 codes (fast path for
# real-width presets) instead of quantizing a normal sample.
_FP4_DIRECT_CODES_ABOVE = 1 << 22
# RMS of a uniformly random e2m1 code (mean of the 8 squared magnitudes).
_E2M1_CODE_RMS = math.sqrt(sum(v * v for v in E2M1_VALUES) / len(E2M1_VALUES))
_OUTPUT_PROJ = (".wo_b.weight", ".w2.weight")


def _normal(shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32, device=gen.device) * std


def _logical_init(spec: TensorSpec, args: ModelArgs, gen: torch.Generator) -> torch.Tensor:
    """float32 logical values of one tensor (before quantization)."""
    name, shape = spec.name, spec.shape
    n = args.hc_mult
    if name == "embed.weight":
        return _normal(shape, 1.0, gen)
    if name.endswith("norm.weight"):
        return 1.0 + _normal(shape, 0.02, gen)
    base = name.rsplit(".", 1)[-1]
    if base.startswith("hc_") and base.endswith("_fn"):
        # m = (f @ fn^T) * rsqrt(mean f^2) ~ N(0, 0.3^2): mixes stay near their base values.
        return _normal(shape, 0.3 / math.sqrt(shape[1]), gen)
    if base.startswith("hc_") and base.endswith("_base"):
        b = _normal(shape, 0.1, gen)
        if shape[0] == args.hc_dim:  # comb logits: favour keeping each stream (diagonal)
            b[2 * n :] += torch.eye(n, device=b.device).flatten()
        return b
    if base.startswith("hc_") and base.endswith("_scale"):
        return 0.5 + _normal(shape, 0.05, gen)
    if base in ("attn_sink", "ape"):
        return _normal(shape, 0.1, gen)
    if base in ("bias", "bias_vl"):
        return _normal(shape, 0.01, gen)
    if base in ("q_weight", "k_weight"):
        return 1.0 + _normal(shape, 0.1, gen)
    if name.endswith("engram.embed.weight"):
        return _normal(shape, 1.0, gen)
    if ".markov_head." in name and (name.endswith("markov_w1.weight") or name.endswith("embed.weight")):
        return _normal(shape, 1.0, gen)
    if ".markov_head." in name:  # low-rank logit bias: keep it small next to the head's logits
        return _normal(shape, 0.1 / math.sqrt(shape[1]), gen)
    if len(shape) == 2:  # every linear [out, in]
        std = 1.0 / math.sqrt(shape[1])
        if name.endswith(_OUTPUT_PROJ):
            std *= 0.5  # residual branch outputs: keep the streams from growing layer over layer
        return _normal(shape, std, gen)
    raise CheckpointError(f"writer: no init rule for tensor '{name}' {list(shape)}")  # pragma: no cover


def _fp4_direct(
    shape: tuple[int, int], std: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    # a uniformly random byte is two independent uniformly random e2m1 codes: draw the packed bytes directly
    # (8x less memory and no packing pass than int64 codes; real-width slices hold tens of GB of experts)
    packed = torch.randint(-128, 128, (shape[0], shape[1] // 2), generator=gen, dtype=torch.int8, device=gen.device)
    scale = 2.0 ** round(math.log2(std / _E2M1_CODE_RMS))
    s = torch.full((shape[0], -(-shape[1] // 32)), scale, dtype=torch.float32, device=gen.device)
    return packed, float_to_e8m0(s)


def init_tensor(spec: TensorSpec, args: ModelArgs, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Stored tensor(s) of one inventory entry: `{name: tensor}` plus `{scale name: scale}` when quantized."""
    if spec.dtype == "i64":  # ffn.gate.tid2eid [vocab, top-k]: distinct experts per token
        n_exp = args.n_routed_experts
        order = torch.rand((spec.shape[0], n_exp), generator=gen, device=gen.device).argsort(dim=1)
        return {spec.name: order[:, : spec.shape[1]].contiguous().to(torch.int64)}
    if spec.dtype == "fp4_e2m1x2":
        assert spec.scale is not None
        std = (0.5 if spec.name.endswith(".w2.weight") else 1.0) / math.sqrt(spec.shape[1])
        if math.prod(spec.shape) > _FP4_DIRECT_CODES_ABOVE:
            q, s = _fp4_direct(spec.shape, std, gen)  # type: ignore[arg-type]
        else:
            q, s = quant_fp4(_normal(spec.shape, std, gen), block=spec.scale.block[1])
        return {spec.name: q, spec.scale.name: s}
    w = _logical_init(spec, args, gen)
    if spec.dtype == "f8_e4m3":
        assert spec.scale is not None
        q, s = quant_fp8_block(w, spec.scale.block, "ue8m0" if spec.scale.dtype == "f8_e8m0" else None)
        return {spec.name: q, spec.scale.name: s}
    if spec.dtype == "bf16":
        return {spec.name: w.to(torch.bfloat16)}
    if spec.dtype == "f32":
        return {spec.name: w}
    raise CheckpointError(
        f"writer: unsupported stored dtype {spec.dtype!r} for '{spec.name}'"
    )  # pragma: no cover


def _plan_shards(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        b = spec.total_bytes
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += b
    return shards


def write_checkpoint(
    out_dir: str | os.PathLike[str],
    config: dict,
    seed: int = 0,
    *,
    max_shard_bytes: int | None = None,
    tokenizer: bool = True,
    overwrite: bool = False,
    device: str | torch.device = "cpu",
) -> Path:
    """Write a random checkpoint for a `config.json` dict into `out_dir` (created); returns the directory.

    `device` is where the random values are drawn and quantized (`cuda` makes real-width slices disk-bound);
    the values depend on it (different random streams), not on anything else.
    """
    from safetensors.torch import save_file

    args = ModelArgs.from_config_dict(config)
    out = Path(out_dir)
    if (out / "config.json").exists() and not overwrite:
        raise CheckpointError(f"{str(out)!r} already holds a checkpoint (config.json); pass overwrite=True")
    out.mkdir(parents=True, exist_ok=True)
    specs = tensor_inventory(args)
    total = sum(s.total_bytes for s in specs)
    if max_shard_bytes is None:
        max_shard_bytes = 10_000_000 if total < 1_000_000_000 else 4_000_000_000
    if max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes: found {max_shard_bytes}, expected a positive byte count")
    plan = _plan_shards(specs, max_shard_bytes)
    gen = torch.Generator(device=torch.device(device)).manual_seed(int(seed))
    weight_map: dict[str, str] = {}
    n = len(plan)
    for k, group in enumerate(plan, start=1):
        fname = f"model-{k:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for spec in group:
            tensors.update(init_tensor(spec, args, gen))
        save_file(
            {k2: v.contiguous().cpu() for k2, v in tensors.items()}, str(out / fname), metadata={"format": "pt"}
        )
        weight_map.update(dict.fromkeys(tensors, fname))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    gen_cfg = {
        "bos_token_id": args.bos_token_id,
        "eos_token_id": args.eos_token_id,
        "do_sample": True,
        "temperature": 1.0,
        "top_p": 1.0,
    }
    (out / "generation_config.json").write_text(json.dumps(gen_cfg, indent=2) + "\n", encoding="utf-8")
    if tokenizer:
        write_tokenizer_files(out, args.arch)
    return out


def make_checkpoint(
    out_dir: str | os.PathLike[str],
    arch: str,
    preset: str,
    seed: int = 0,
    *,
    max_shard_bytes: int | None = None,
    overwrite: bool = False,
    n_routed_experts: int | None = None,
    device: str | torch.device = "cpu",
) -> Path:
    """`deepinfer make-checkpoint`: a random checkpoint of preset `tiny | tiny-dspark | layers-N | full`
    (`n_routed_experts` overrides the routed-expert count, see `preset_config`)."""
    return write_checkpoint(
        out_dir, preset_config(arch, preset, n_routed_experts=n_routed_experts), seed,
        max_shard_bytes=max_shard_bytes, overwrite=overwrite, device=device,
    )


def iter_shard_plan(config: dict, max_shard_bytes: int) -> Iterator[list[str]]:
    """Tensor names per shard that `write_checkpoint` would produce (for tests and dry runs)."""
    for group in _plan_shards(tensor_inventory(ModelArgs.from_config_dict(config)), max_shard_bytes):
        yield [s.name for s in group]
