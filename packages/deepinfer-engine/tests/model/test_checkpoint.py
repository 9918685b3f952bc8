"""Writer -> reader round trip of tiny checkpoints, and every reader error path."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from deepinfer_engine.errors import CheckpointError
from deepinfer_engine.model import presets
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.checkpoint import INDEX_FILE, CheckpointReader, read_safetensors_header
from deepinfer_engine.model.inventory import tensor_inventory
from deepinfer_engine.model.writer import init_tensor
from engine_testing import make_tiny_checkpoint
from safetensors.torch import load_file, save_file


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "v4": make_tiny_checkpoint(root / "v4", arch="v4", seed=3),
        "v41": make_tiny_checkpoint(root / "v41", arch="v41", seed=4),
    }


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, copy_function=os.link)  # hard links: cheap; files we modify are replaced first
    return dst


def _private(path: Path) -> Path:
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return path


def _shard_holding(d: Path, name: str) -> Path:
    wm = json.loads((d / INDEX_FILE).read_text())["weight_map"]
    return d / wm[name]


@pytest.mark.parametrize("arch", ["v4", "v41"])
def test_round_trip_raw_and_dequantized(tiny_dirs: dict[str, Path], arch: str) -> None:
    d = tiny_dirs[arch]
    seed = 3 if arch == "v4" else 4
    files = sorted(p.name for p in d.iterdir())
    shards = [f for f in files if f.startswith("model-0")]
    assert len(shards) >= 3 and all(f.endswith(f"-of-{len(shards):05d}.safetensors") for f in shards)
    for f in ("config.json", "generation_config.json", INDEX_FILE, "tokenizer.json", "tokenizer_config.json"):
        assert f in files
    assert sum((d / s).stat().st_size for s in shards) < 50_000_000
    args = ModelArgs.from_checkpoint_dir(d)
    assert args == ModelArgs.from_config_dict(presets.preset_config(arch, "tiny"))
    # regenerate the same tensors in memory (same seed, same order) and compare with what was read back
    gen = torch.Generator().manual_seed(seed)
    with CheckpointReader(d) as r:
        assert r.problems() == []
        r.check()
        assert r.total_size == r.stored_nbytes()
        for spec in tensor_inventory(args):
            want = init_tensor(spec, args, gen)
            for name, t in want.items():
                got = r.load_raw(name)
                assert got.dtype == t.dtype and got.shape == t.shape, name
                assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8)), name
            logical = r.load(spec.name)
            assert tuple(logical.shape) == spec.shape and torch.isfinite(logical.float()).all(), spec.name


def test_dequantized_values_match_a_hand_loop(tiny_dirs: dict[str, Path]) -> None:
    with CheckpointReader(tiny_dirs["v41"]) as r:
        # FP8 with 32x32 UE8M0 blocks: [32, 64] -> scale [1, 2]
        q = r.load_raw("layers.0.attn.wq_a.weight").float()
        s = r.load_raw("layers.0.attn.wq_a.scale").view(torch.uint8).int()
        w = r.load("layers.0.attn.wq_a.weight")
        for i, j in [(0, 0), (31, 31), (0, 32), (17, 63)]:
            assert w[i, j].item() == q[i, j].item() * 2.0 ** (s[i // 32, j // 32].item() - 127)
        # FP4: low nibble = even column, 1x32 scales
        lut = [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
        packed = r.load_raw("layers.2.ffn.experts.3.w2.weight").view(torch.uint8).int()
        sc = r.load_raw("layers.2.ffn.experts.3.w2.scale").view(torch.uint8).int()
        e = r.load("layers.2.ffn.experts.3.w2.weight")
        assert e.shape == (64, 32)
        for i, j in [(0, 0), (0, 1), (5, 30), (63, 31)]:
            byte = packed[i, j // 2].item()
            code = (byte & 15) if j % 2 == 0 else (byte >> 4)
            assert e[i, j].item() == lut[code] * 2.0 ** (sc[i, j // 32].item() - 127)
        # Engram table: 1x32 blocks over head_dim 16 -> one scale per row
        t = r.load("layers.1.engram.embed.weight", dtype=torch.bfloat16)
        assert t.dtype == torch.bfloat16 and t.shape == (462, 16)
        assert r.load("layers.0.ffn.gate.bias").dtype == torch.float32


def test_v4_tid2eid_is_int64_and_distinct(tiny_dirs: dict[str, Path]) -> None:
    with CheckpointReader(tiny_dirs["v4"]) as r:
        t = r.load("layers.0.ffn.gate.tid2eid", dtype=torch.bfloat16)
        assert t.dtype == torch.int64 and t.shape == (129280, 2)
        assert (t[:, 0] != t[:, 1]).all() and t.min() >= 0 and t.max() < 8


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path, tiny_dirs: dict[str, Path]) -> None:
    d = make_tiny_checkpoint(tmp_path / "again", arch="v4", seed=3)
    for f in sorted(p.name for p in d.iterdir()):
        assert (d / f).read_bytes() == (tiny_dirs["v4"] / f).read_bytes(), f
    other = make_tiny_checkpoint(tmp_path / "other", arch="v4", seed=5, max_shard_bytes=3_000_000)
    a = CheckpointReader(other).load_raw("layers.1.attn.wkv.weight").float()
    b = CheckpointReader(d).load_raw("layers.1.attn.wkv.weight").float()
    assert not torch.equal(a, b)
    assert len(list(other.glob("model-*.safetensors"))) > len(list(d.glob("model-*.safetensors")))


def test_tiny_dspark_v4_preset(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "ds", arch="v4", preset="tiny-dspark")
    with CheckpointReader(d) as r:
        r.check()
        assert "mtp.2.markov_head.markov_w1.weight" in r and "mtp.0.main_proj.weight" in r
        assert r.args.num_draft_layers == 3


# ---------------------------------------------------------------------------------------------------
# error paths


def _rewrite_shard(path: Path, change) -> None:
    tensors = load_file(str(path))
    change(tensors)
    path.unlink()
    save_file(tensors, str(path), metadata={"format": "pt"})


# The damage cases shared with `inspect --verify` (missing shard / tensor, wrong shape / dtype, truncated shard,
# corrupted header, ...) live in the corpus of tests/conftest.py; test_damaged_checkpoints.py asserts the error
# each raises when the checkpoint is opened. The tests below add what only the reader API shows.


def test_tensor_listed_in_index_but_absent_from_its_shard(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_dirs["v41"], tmp_path / "c")
    name = "layers.4.attn.indexer.wk.weight"
    shard = _shard_holding(d, name)
    _rewrite_shard(shard, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"'{name}'.*{shard.name}.*lacks it"):
        CheckpointReader(d)


def test_missing_tensor_fails_its_load_and_the_check(damaged_checkpoint) -> None:
    name = "layers.4.attn.indexer.wk.weight"
    r = CheckpointReader(damaged_checkpoint("missing_tensor"))
    assert f"missing tensor '{name}'" in r.problems()
    with pytest.raises(CheckpointError, match=rf"'{name}' is missing"):
        r.load(name)
    with pytest.raises(CheckpointError, match=r"\(2 problems\): missing tensor.*total_size"):
        r.check()


@pytest.mark.parametrize(("case", "found"), [("wrong_shape", r"BF16 \[63\]"), ("wrong_dtype", r"F16 \[64\]")])
def test_wrong_shape_or_dtype_fails_the_load(damaged_checkpoint, case: str, found: str) -> None:
    d = damaged_checkpoint(case)
    r = CheckpointReader(d)
    shard = _shard_holding(d, "norm.weight").name
    with pytest.raises(CheckpointError, match=rf"'norm.weight' in {shard}: found {found}, expected BF16 \[64\]"):
        r.load("norm.weight")


def test_shard_shorter_than_its_first_8_bytes(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_dirs["v41"], tmp_path / "c")
    shard = _private(_shard_holding(d, "layers.3.attn.wq_a.weight"))
    os.truncate(shard, 5)
    with pytest.raises(CheckpointError, match=rf"shard {shard.name}: truncated"):
        CheckpointReader(d)


def test_header_length_past_end_of_file(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_dirs["v41"], tmp_path / "c")
    shard = _private(_shard_holding(d, "layers.3.attn.wq_a.weight"))
    data = bytearray(shard.read_bytes())
    data[0:8] = struct.pack("<Q", len(data) * 2)
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"shard {shard.name}: header length"):
        read_safetensors_header(shard)


def test_header_offsets_inconsistent_with_shape(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_dirs["v4"], tmp_path / "c")
    shard = _private(_shard_holding(d, "norm.weight"))
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["norm.weight"]["shape"] = [65]
    new = json.dumps(header, separators=(",", ":")).encode().ljust(n)
    assert len(new) == n
    shard.write_bytes(raw[:8] + new + raw[8 + n :])
    with pytest.raises(CheckpointError, match=r"'norm.weight' occupies bytes .* needs 130 bytes"):
        CheckpointReader(d)


def test_missing_index_and_directory(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_dirs["v4"], tmp_path / "c")
    (d / INDEX_FILE).unlink()
    with pytest.raises(CheckpointError, match=f"no {INDEX_FILE}"):
        CheckpointReader(d)
    with pytest.raises(CheckpointError, match="does not exist"):
        CheckpointReader(tmp_path / "nowhere")


def test_config_mismatch(tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    d = _copy(tiny_dirs["v4"], tmp_path / "c")
    with pytest.raises(CheckpointError, match=r"o_lora_rank: given 8, config.json 16"):
        CheckpointReader(d, args=ModelArgs.from_checkpoint_dir(d).replace(o_lora_rank=8))
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 64
    (d / "config.json").unlink()
    (d / "config.json").write_text(json.dumps(cfg))
    r = CheckpointReader(d)
    with pytest.raises(
        CheckpointError,
        match=r"does not match its config .*experts.0.w1.weight.*shape \[32, 32\], expected \[64, 32\]",
    ):
        r.check()


def test_fp4_direct_code_path_for_real_width_experts() -> None:
    # a real V4-Flash expert [2048, 4096] is drawn as random e2m1 codes with one power-of-two scale
    args = ModelArgs.from_config_dict(presets.v4_flash_config())
    spec = next(s for s in tensor_inventory(args) if s.name == "layers.3.ffn.experts.0.w1.weight")
    out = init_tensor(spec, args, torch.Generator().manual_seed(0))
    q, s = out[spec.name], out[spec.scale.name]
    assert q.dtype == torch.int8 and q.shape == (2048, 2048) and s.shape == (2048, 128)
    from deepinfer_kernels.quant import dequant_fp4

    w = dequant_fp4(q[:64], s[:64])
    std = w.std().item()
    assert 0.5 / 64 < std < 2.0 / 64  # target 1/sqrt(4096), within the power-of-two rounding


def test_layers_n_shard_plan_uses_real_widths() -> None:
    from deepinfer_engine.model.writer import iter_shard_plan

    cfg = presets.preset_config("v41", "layers-2")
    args = ModelArgs.from_config_dict(cfg)
    assert args.hidden_size == 5120 and args.num_hidden_layers == 2 and args.engram_layer_ids == (1,)
    shards = list(iter_shard_plan(cfg, 4_000_000_000))
    assert len(shards) > 3 and sum(map(len, shards)) == len(tensor_inventory(args))


def test_random_weights_keep_activations_well_conditioned(tiny_dirs: dict[str, Path]) -> None:
    loader = pytest.importorskip("deepinfer_engine.model.loader")
    from deepinfer_engine.model.cache import ModelCache
    from deepinfer_engine.model.forward_batch import ForwardBatch

    for arch in ("v4", "v41"):
        # synthetic Engram token map (docs/testing.md §9.2) keeps this test fast; the real map is G's to test
        tmap = torch.arange(129280).numpy() % 99092 if arch == "v41" else None
        model = loader.load_model(tiny_dirs[arch], dtype=torch.float32, token_map=tmap)
        rms: list[float] = []
        for layer in model.layers:
            layer.register_forward_hook(
                lambda mod, inp, out, rms=rms: rms.append(
                    float((out[0] if isinstance(out, tuple) else out).pow(2).mean().sqrt())
                )
            )
        ids = torch.randint(0, 129000, (12,), generator=torch.Generator().manual_seed(0))
        cache, bt = ModelCache.allocate_dense(model.args, [12], dtype=torch.float32)
        with torch.inference_mode():
            logits = model.forward(ForwardBatch.single(ids, block_table=bt), cache)
        assert len(rms) == model.args.num_hidden_layers
        assert all(0.3 < v < 4.0 for v in rms), (arch, rms)
        assert torch.isfinite(logits).all() and 0.3 < logits.std().item() < 3.0


@pytest.mark.gpu
def test_load_on_cuda_matches_cpu(tiny_dirs: dict[str, Path]) -> None:
    with CheckpointReader(tiny_dirs["v41"]) as r:
        for name in (
            "layers.2.attn.wq_b.weight",
            "layers.5.ffn.experts.2.w3.weight",
            "layers.1.engram.embed.weight",
        ):
            cpu = r.load(name)
            gpu = r.load(name, device="cuda")
            assert gpu.device.type == "cuda" and torch.equal(gpu.cpu(), cpu), name


def test_v4_base_style_fp8_experts_with_float32_scales(tmp_path: Path) -> None:
    # V4-Flash-Base: FP8 block experts and float32 scales (no scale_fmt) (docs/model.md §1.1, §6.2)
    from deepinfer_engine.model.writer import write_checkpoint

    cfg = presets.tiny_v4_config()
    cfg["expert_dtype"] = "fp8"
    del cfg["quantization_config"]["scale_fmt"]
    d = write_checkpoint(tmp_path / "base", cfg, seed=0, tokenizer=False)
    with CheckpointReader(d) as r:
        r.check()
        raw = r.load_raw("layers.2.ffn.experts.0.w2.weight")
        scale = r.load_raw("layers.2.ffn.experts.0.w2.scale")
        assert raw.dtype == torch.float8_e4m3fn and raw.shape == (64, 32)
        assert scale.dtype == torch.float32 and scale.shape == (1, 1)
        assert torch.equal(r.load("layers.2.ffn.experts.0.w2.weight"), raw.float() * scale[0, 0])
