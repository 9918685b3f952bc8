"""The corpus of damaged checkpoints, shared by the model tests (typed errors) and the command tests (`inspect
--verify` findings).

One tiny V4.1 checkpoint is written per session; each case copies it (hard links: cheap; a file a case changes
is replaced, never written through the link) and applies one damage. A case names what must catch it:
`finding` (regex over the `inspect --verify` finding messages, with its `kind`) and, for damage the loader
must refuse, `error` = (exception type, regex, stage) where stage is the call that raises: "args" (config.json),
"reader" (opening the checkpoint), "check" (the inventory check), "eos" (generation_config.json), "tokenizer".
Tests take a `damage_case` argument (parametrized over every case by `pytest_generate_tests`) or an
`error_case` one (the cases with an `error`), and the `damaged_checkpoint` factory.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from deepinfer_engine.errors import CheckpointError, ModelConfigError

INDEX = "model.safetensors.index.json"
_NAN = {"BF16": b"\xc0\x7f", "F32": struct.pack("<f", math.nan), "F8_E4M3": b"\x7f", "F8_E8M0": b"\xff"}
_INF = {"BF16": b"\x80\x7f", "F32": struct.pack("<f", math.inf)}


@dataclass(frozen=True)
class Damage:
    apply: Callable[[Path], None]
    kind: str
    finding: str
    error: tuple[type[Exception], str, str] | None = None


# ---------------------------------------------------------------------------------------------------------
# helpers: every writer replaces the file (unlink first) so the hard-linked base stays intact


def _replace(path: Path, data: bytes | str) -> None:
    path.unlink()
    if isinstance(data, str):
        path.write_text(data, encoding="utf-8")
    else:
        path.write_bytes(data)


def _edit_json(d: Path, name: str, change: Callable[[dict], object]) -> None:
    data = json.loads((d / name).read_text(encoding="utf-8"))
    change(data)
    _replace(d / name, json.dumps(data))


def shard_of(d: Path, tensor: str) -> Path:
    return d / json.loads((d / INDEX).read_text())["weight_map"][tensor]


def _split(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_shard(path: Path, header: dict, data: bytes) -> None:
    # the header may change length: data offsets are relative to the data start, so the data moves along
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    _replace(path, struct.pack("<Q", len(head)) + head + data)


def _edit_header(d: Path, tensor: str, change: Callable[[dict], object]) -> None:
    path = shard_of(d, tensor)
    header, data = _split(path)
    change(header)
    _write_shard(path, header, data)


def _poke(d: Path, tensor: str, flat_indices: range | list[int], code: dict[str, bytes]) -> None:
    """Overwrite the values at `flat_indices` of `tensor` with the byte code for its dtype."""
    path = shard_of(d, tensor)
    header, data = _split(path)
    entry = header[tensor]
    value = code[entry["dtype"]]
    buf = bytearray(data)
    for i in flat_indices:
        at = entry["data_offsets"][0] + i * len(value)
        buf[at : at + len(value)] = value
    _write_shard(path, header, bytes(buf))


def _rewrite_tensors(d: Path, tensor: str, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    from safetensors.torch import load_file, save_file

    path = shard_of(d, tensor)
    tensors = load_file(str(path))
    change(tensors)
    path.unlink()
    save_file(tensors, str(path), metadata={"format": "pt"})


def _truncate(d: Path, tensor: str, nbytes: int) -> None:
    path = shard_of(d, tensor)
    _replace(path, path.read_bytes()[:-nbytes])


def _overlap(header: dict) -> None:
    # two same-sized tensors: the second is pointed at the first one's bytes
    a, b = "layers.0.attn.wq_a.weight", "layers.0.attn.wkv.weight"
    header[b]["data_offsets"] = header[a]["data_offsets"]


def _outside(header: dict) -> None:
    e = header["norm.weight"]
    size = e["data_offsets"][1] - e["data_offsets"][0]
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    e["data_offsets"] = [end + 64, end + 64 + size]


def _drop_tensor(d: Path) -> None:
    name = "layers.4.attn.indexer.wk.weight"
    _rewrite_tensors(d, name, lambda t: t.pop(name))
    _edit_json(d, INDEX, lambda i: i["weight_map"].pop(name))


def _corrupt_header(d: Path) -> None:
    path = shard_of(d, "layers.3.attn.wq_a.weight")
    data = bytearray(path.read_bytes())
    data[8:20] = b"#not json!#!"
    _replace(path, bytes(data))


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda obj: obj.__setitem__(key, value)


# ---------------------------------------------------------------------------------------------------------
# the corpus

DAMAGES: dict[str, Damage] = {
    # index file
    "index_not_json": Damage(
        lambda d: _replace(d / INDEX, "{not json"), "index", f"{INDEX}: unreadable",
        (CheckpointError, f"{INDEX}: unreadable", "reader")),
    "index_metadata_not_object": Damage(
        lambda d: _edit_json(d, INDEX, _set("metadata", [1, 2])), "index", "field 'metadata' is \\[1, 2\\]",
        (CheckpointError, f"{INDEX}: field 'metadata' is \\[1, 2\\], expected an object", "reader")),
    "index_total_size_not_integer": Damage(
        lambda d: _edit_json(d, INDEX, lambda i: i["metadata"].__setitem__("total_size", "38MB")), "index",
        "field 'metadata.total_size' is '38MB'",
        (CheckpointError, "'metadata.total_size' is '38MB', expected a non-negative integer", "reader")),
    "index_weight_map_bad_entry": Damage(
        lambda d: _edit_json(d, INDEX, lambda i: i["weight_map"].__setitem__("norm.weight", 7)), "index",
        "field 'weight_map.norm.weight' is 7",
        (CheckpointError, "'weight_map.norm.weight' is 7, expected a shard file name", "reader")),
    "index_total_size_wrong": Damage(
        lambda d: _edit_json(d, INDEX, lambda i: i["metadata"].__setitem__("total_size", 5)), "inventory",
        "total_size 5 != stored tensor bytes", (CheckpointError, "total_size 5 != stored tensor bytes", "check")),
    # shard headers
    "shard_metadata_not_object": Damage(
        lambda d: _edit_header(d, "norm.weight", _set("__metadata__", ["pt"])), "header",
        "header field '__metadata__' is \\['pt'\\]",
        (CheckpointError, "shard model-0000.*'__metadata__' is \\['pt'\\]; expected an object", "reader")),
    "overlapping_offsets": Damage(
        lambda d: _edit_header(d, "layers.0.attn.wq_a.weight", _overlap), "header",
        "tensors 'layers.0.attn.wkv.weight' .* and 'layers.0.attn.wq_a.weight' .* overlap",
        (CheckpointError, "tensors 'layers.0.attn.wkv.weight' \\(bytes \\[\\d+, \\d+\\)\\) and "
         "'layers.0.attn.wq_a.weight' \\(bytes \\[\\d+, \\d+\\)\\) overlap", "reader")),
    "offsets_outside_file": Damage(
        lambda d: _edit_header(d, "norm.weight", _outside), "header", "'norm.weight' ends at data byte",
        (CheckpointError, "tensor 'norm.weight' ends at data byte .*truncated file", "reader")),
    "corrupted_header": Damage(
        _corrupt_header, "header", "corrupted header", (CheckpointError, "corrupted header", "reader")),
    "truncated_shard": Damage(
        lambda d: _truncate(d, "layers.3.attn.wq_a.weight", 100), "header", "ends at data byte .*truncated",
        (CheckpointError, "ends at data byte .*truncated", "reader")),
    "missing_shard": Damage(
        lambda d: shard_of(d, "head.weight").unlink(), "header", "listed in .* but missing",
        (CheckpointError, f"listed in {INDEX} .* is missing", "reader")),
    # inventory (shapes / dtypes / names against config.json)
    "missing_tensor": Damage(
        _drop_tensor, "inventory", "missing tensor 'layers.4.attn.indexer.wk.weight'",
        (CheckpointError, "missing tensor 'layers.4.attn.indexer.wk.weight'", "check")),
    "wrong_shape": Damage(
        lambda d: _rewrite_tensors(d, "norm.weight", _set("norm.weight", torch.ones(63, dtype=torch.bfloat16))),
        "inventory", "'norm.weight' .*shape \\[63\\], expected \\[64\\]",
        (CheckpointError, "'norm.weight' .*shape \\[63\\], expected \\[64\\]", "check")),
    "wrong_dtype": Damage(
        lambda d: _rewrite_tensors(d, "norm.weight", _set("norm.weight", torch.ones(64, dtype=torch.float16))),
        "inventory", "'norm.weight' .*dtype F16, expected BF16",
        (CheckpointError, "'norm.weight' .*dtype F16, expected BF16", "check")),
    # small files
    "config_not_json": Damage(
        lambda d: _replace(d / "config.json", "{oops"), "config", "config.json.* is not valid JSON",
        (ModelConfigError, "is not valid JSON", "args")),
    "generation_config_eos_string": Damage(
        lambda d: _edit_json(d, "generation_config.json", _set("eos_token_id", "one")), "file",
        "generation_config.json .*'eos_token_id' is 'one'",
        (CheckpointError, "generation_config.json .*field 'eos_token_id' is 'one'; expected a token id", "eos")),
    "generation_config_eos_outside_vocab": Damage(
        lambda d: _edit_json(d, "generation_config.json", _set("eos_token_id", [1, 200000])), "file",
        "'eos_token_id\\[1\\]' is 200000",
        (CheckpointError, "'eos_token_id\\[1\\]' is 200000; expected a token id \\(integer in \\[0, 129280\\)\\)",
         "eos")),
    "generation_config_bad_type": Damage(
        lambda d: _edit_json(d, "generation_config.json", _set("temperature", "hot")), "file",
        "'temperature' is 'hot'", (CheckpointError, "'temperature' is 'hot'; expected a finite number", "eos")),
    "generation_config_not_json": Damage(
        lambda d: _replace(d / "generation_config.json", "eos_token_id: 1"), "file",
        "generation_config.json: not valid JSON",
        (CheckpointError, "generation_config.json: not valid JSON", "eos")),
    "tokenizer_garbage": Damage(
        lambda d: _replace(d / "tokenizer.json", '{"model": 42}'), "file", "tokenizer.json: not a valid tokenizer",
        (CheckpointError, "tokenizer.json: not a valid tokenizer.json", "tokenizer")),
    "tokenizer_not_utf8": Damage(
        lambda d: _replace(d / "tokenizer.json", b"\xff\xfe{}"), "file", "tokenizer.json: not UTF-8",
        (CheckpointError, "tokenizer.json: not UTF-8 text", "tokenizer")),
    "tokenizer_config_not_object": Damage(
        lambda d: _replace(d / "tokenizer_config.json", "[1, 2]"), "file",
        "tokenizer_config.json: found a JSON list",
        (CheckpointError, "tokenizer_config.json: found a JSON list, expected an object", "tokenizer")),
    "tokenizer_config_unknown_token": Damage(
        lambda d: _edit_json(d, "tokenizer_config.json", _set("eos_token", "<eos-typo>")), "file",
        "'eos_token' is '<eos-typo>'",
        (CheckpointError, "tokenizer_config.json: field 'eos_token' is '<eos-typo>'; expected a token", "tokenizer")),
    # values that load fine but compute garbage: --verify only
    "nan_norm_weight": Damage(
        lambda d: _poke(d, "norm.weight", [5], _NAN), "non_finite",
        "'norm.weight' .*1 NaN and 0 Inf among 64 BF16 values \\(first at \\[5\\]\\)"),
    "inf_head_row": Damage(
        lambda d: _poke(d, "head.weight", range(7 * 64, 8 * 64), _INF), "non_finite",
        "'head.weight' .*0 NaN and 64 Inf among 8273920 BF16 values \\(first at \\[7, 0\\]\\)"),
    "e8m0_nan_scale": Damage(
        lambda d: _poke(d, "layers.0.ffn.experts.0.w1.scale", [3], _NAN), "invalid_scale",
        "'layers.0.ffn.experts.0.w1.scale' .*1 NaN code 0xFF of E8M0 among 64 values \\(first at \\[1, 1\\]\\)"),
    "fp8_nan_weight": Damage(
        lambda d: _poke(d, "layers.0.attn.wq_a.weight", [64 + 2], _NAN), "non_finite",
        "'layers.0.attn.wq_a.weight' .*1 NaN code 0x7F/0xFF of FP8 e4m3 among 2048 values \\(first at \\[1, 2\\]\\)"),
    "f32_nan_value": Damage(
        lambda d: _poke(d, "layers.0.attn.attn_sink", [0], _NAN), "non_finite",
        "'layers.0.attn.attn_sink' .*1 NaN and 0 Inf among .* F32 values"),
}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "damage_case" in metafunc.fixturenames:
        metafunc.parametrize("damage_case", sorted(DAMAGES))
    if "error_case" in metafunc.fixturenames:
        metafunc.parametrize("error_case", sorted(k for k, v in DAMAGES.items() if v.error is not None))


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`(arch, preset="tiny", seed=0) -> directory` of that random checkpoint, written once per session (a write
    takes seconds; tests only read it: a test that adds files copies it first). The directory is named after
    `arch` ("v41" / "v4"): tests pick the page size by it."""
    from deepinfer_engine.model.writer import make_checkpoint

    made: dict[tuple[str, str, int], Path] = {}

    def get(arch: str, preset: str = "tiny", seed: int = 0) -> Path:
        key = (arch, preset, seed)
        if key not in made:
            made[key] = make_checkpoint(tmp_path_factory.mktemp(f"{preset}_{arch}_{seed}") / arch, arch, preset, seed)
        return made[key]

    return get


@pytest.fixture(scope="session")
def damage_base(tiny_ckpt: Callable[..., Path]) -> Path:
    # cases copy it as hard links and replace (never write through) the files they damage
    return tiny_ckpt("v41")


@pytest.fixture(scope="session")
def damaged_checkpoint(damage_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`(*cases) -> directory`: a copy of the base checkpoint with the damage of each `DAMAGES[case]` applied,
    made once per combination and session (tests only read it)."""
    root = tmp_path_factory.mktemp("damaged")

    def make(*cases: str) -> Path:
        d = root / "+".join(cases)
        if not d.exists():
            shutil.copytree(damage_base, d, copy_function=os.link)
            for case in cases:
                DAMAGES[case].apply(d)
        return d

    return make


@pytest.fixture(scope="session")
def damage_corpus() -> dict[str, Damage]:
    return DAMAGES


@pytest.fixture
def damage(request: pytest.FixtureRequest) -> Damage:
    """The `Damage` of the test's `damage_case` or `error_case` argument."""
    params = request.node.callspec.params
    return DAMAGES[params.get("damage_case") or params["error_case"]]
