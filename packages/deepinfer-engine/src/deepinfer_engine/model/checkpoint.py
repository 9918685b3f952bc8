"""Reader of the official checkpoint format: `model.safetensors.index.json` + `model-000NN-of-000MM.safetensors`.

Lazy and memory-mapped (safetensors `safe_open`): opening a checkpoint reads only the index and each shard's
JSON header; a tensor's bytes are touched when it is loaded. Never unpickles anything. Shapes and dtypes are
checked against `tensor_inventory(args)`; every error is a `CheckpointError` naming the tensor, the shard file,
and what was expected vs found. Dequantization (FP8 block scales, FP4 + E8M0) uses `deepinfer_kernels.quant`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from deepinfer_kernels.quant import dequant_fp4, dequant_fp8_block

from deepinfer_engine.errors import CheckpointError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.inventory import SAFETENSORS_DTYPE, ScaleSpec, TensorSpec, tensor_inventory

__all__ = ["INDEX_FILE", "CheckpointReader", "HeaderEntry", "read_index", "read_safetensors_header"]

INDEX_FILE = "model.safetensors.index.json"
# Element sizes of the safetensors dtypes we may meet (others are rejected by name).
_ST_ITEMSIZE = {
    "BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip
# A header larger than this is not a real safetensors header (the format caps it at 100 MB).
_MAX_HEADER = 100_000_000


@dataclass(frozen=True)
class HeaderEntry:
    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]


def read_safetensors_header(path: Path) -> tuple[dict[str, HeaderEntry], dict[str, str]]:
    """Parse and sanity-check a shard's header without reading tensor data.

    Detects: file shorter than its header or its data (truncated), unparsable / inconsistent header (corrupted,
    including a `__metadata__` that is not an object of strings), tensors whose byte range does not match
    dtype x shape or overlaps another tensor's range.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(
                    f"shard {path.name}: truncated ({size} bytes; a safetensors file starts with 8)"
                )
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise CheckpointError(
                    f"shard {path.name}: header length {n} does not fit in the file of {size} bytes "
                    "(truncated or corrupted file)"
                )
            raw = f.read(n)
    except OSError as exc:
        raise CheckpointError(f"shard {path.name}: cannot read ({exc})") from exc
    try:
        header = json.loads(raw.decode("utf-8"))
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"shard {path.name}: corrupted header ({exc})") from None
    meta = header.pop("__metadata__", None)
    if meta is None:
        meta = {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CheckpointError(
            f"shard {path.name}: header field '__metadata__' is {_short(meta)}; expected an object of strings "
            "(corrupted header)"
        )
    data_size = size - 8 - n
    entries: dict[str, HeaderEntry] = {}
    for name, info in header.items():
        try:
            dtype = info["dtype"]
            shape = tuple(_strict_int(x) for x in info["shape"])
            begin, end = (_strict_int(x) for x in info["data_offsets"])
            if not isinstance(dtype, str) or any(s < 0 for s in shape):
                raise ValueError
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(
                f"shard {path.name}: corrupted header entry for tensor '{name}': {_short(info)}"
            ) from None
        if dtype not in _ST_ITEMSIZE:
            raise CheckpointError(f"shard {path.name}: tensor '{name}' has unsupported dtype {dtype!r}")
        want = _ST_ITEMSIZE[dtype]
        for s in shape:
            want *= s
        if end - begin != want or begin < 0:
            raise CheckpointError(
                f"shard {path.name}: tensor '{name}' occupies bytes [{begin}, {end}) but {dtype} {list(shape)} "
                f"needs {want} bytes (corrupted header)"
            )
        if end > data_size:
            raise CheckpointError(
                f"shard {path.name}: tensor '{name}' ends at data byte {end} but the file holds only {data_size} "
                f"data bytes (truncated file: {size} bytes, expected at least {8 + n + end})"
            )
        entries[name] = HeaderEntry(dtype=dtype, shape=shape, offsets=(begin, end))
    _check_overlaps(path, entries)
    return entries, dict(meta)


def _check_overlaps(path: Path, entries: dict[str, HeaderEntry]) -> None:
    # two tensors sharing bytes would alias each other's values silently; empty tensors occupy nothing
    spans = sorted((e.offsets[0], e.offsets[1], name) for name, e in entries.items() if e.offsets[1] > e.offsets[0])
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(
                f"shard {path.name}: tensors '{n0}' (bytes [{b0}, {e0})) and '{n1}' (bytes [{b1}, {e1})) overlap; "
                "expected disjoint data ranges (corrupted header)"
            )


def _strict_int(x: object) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"expected an integer, found {x!r}")
    return x


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def read_index(path: Path) -> tuple[dict[str, str], int | None]:
    """`model.safetensors.index.json` -> (weight_map {tensor: shard file}, metadata.total_size or None).

    Every malformed field is a `CheckpointError` naming the file and the field."""
    try:
        index = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path.name}: unreadable ({exc})") from None
    if not isinstance(index, dict):
        raise CheckpointError(f"{path.name}: found a JSON {type(index).__name__}, expected an object")
    meta = index.get("metadata")
    if meta is None:
        meta = {}
    if not isinstance(meta, dict):
        raise CheckpointError(f"{path.name}: field 'metadata' is {_short(meta)}, expected an object")
    total = meta.get("total_size")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 0):
        raise CheckpointError(
            f"{path.name}: field 'metadata.total_size' is {_short(total)}, expected a non-negative integer "
            "(bytes of all tensors)"
        )
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not wm:
        raise CheckpointError(
            f"{path.name}: field 'weight_map' is {_short(wm)}, expected a non-empty object {{tensor: shard file}}"
        )
    for name, shard in wm.items():
        if not isinstance(shard, str) or not shard:
            raise CheckpointError(
                f"{path.name}: field 'weight_map.{name}' is {_short(shard)}, expected a shard file name"
            )
        if os.sep in shard or "/" in shard or shard.startswith("."):
            raise CheckpointError(
                f"{path.name}: field 'weight_map.{name}': shard name {shard!r} is not a plain file name"
            )
    return dict(wm), total


class CheckpointReader:
    """Index + shards of one checkpoint directory.

    ``CheckpointReader(dir)`` parses `config.json` into `args` (or takes `args`, which must equal the
    directory's config), reads the index and every shard header and cross-checks them. Tensor data is read
    lazily by `load` / `load_raw`. Use as a context manager or call `close()` to drop the mmaps.
    """

    def __init__(self, directory: str | os.PathLike[str], args: ModelArgs | None = None) -> None:
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError(f"checkpoint directory {str(self.directory)!r} does not exist")
        on_disk = ModelArgs.from_checkpoint_dir(self.directory)
        if args is not None and args != on_disk:
            diff = [
                f"{k}: given {getattr(args, k)!r}, config.json {getattr(on_disk, k)!r}"
                for k in args.__dataclass_fields__
                if k != "layer_plans" and getattr(args, k) != getattr(on_disk, k)
            ]
            raise CheckpointError(
                f"model args do not match {self.directory / 'config.json'}: " + "; ".join(diff[:6])
            )
        self.args: ModelArgs = on_disk
        self._specs: dict[str, TensorSpec | ScaleSpec] = {}
        self._weights: dict[str, TensorSpec] = {}
        for spec in tensor_inventory(self.args):
            self._specs[spec.name] = spec
            self._weights[spec.name] = spec
            if spec.scale is not None:
                self._specs[spec.scale.name] = spec.scale
        self._weight_map, self.total_size = self._read_index()
        self._headers: dict[str, dict[str, HeaderEntry]] = {}
        self._handles: dict[str, Any] = {}
        for shard in sorted(set(self._weight_map.values())):
            path = self.directory / shard
            if not path.is_file():
                names = [n for n, s in self._weight_map.items() if s == shard]
                raise CheckpointError(
                    f"shard {shard} listed in {INDEX_FILE} (for {len(names)} tensors, e.g. '{names[0]}') is missing "
                    f"from {str(self.directory)!r}"
                )
            self._headers[shard], _ = read_safetensors_header(path)
        for name, shard in self._weight_map.items():
            if name not in self._headers[shard]:
                raise CheckpointError(
                    f"tensor '{name}' is listed in {INDEX_FILE} for shard {shard} but that shard lacks it"
                )
        for shard, entries in self._headers.items():
            for name in entries:
                if self._weight_map.get(name) != shard:
                    raise CheckpointError(
                        f"tensor '{name}' is stored in shard {shard} but {INDEX_FILE} maps it to "
                        f"{self._weight_map.get(name)!r}"
                    )

    # ----------------------------------------------------------------------------------------------
    def _read_index(self) -> tuple[dict[str, str], int | None]:
        path = self.directory / INDEX_FILE
        if not path.is_file():
            raise CheckpointError(
                f"no {INDEX_FILE} in {str(self.directory)!r}; expected the official sharded layout"
            )
        return read_index(path)

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._handles.clear()

    # ----------------------------------------------------------------------------------------------
    # queries
    def tensor_names(self) -> list[str]:
        """Names stored in the checkpoint (weights and scales), in index order."""
        return list(self._weight_map)

    def __contains__(self, name: object) -> bool:
        return name in self._weight_map

    def shard_of(self, name: str) -> str:
        if name not in self._weight_map:
            raise CheckpointError(self._missing_message(name))
        return self._weight_map[name]

    def spec(self, name: str) -> TensorSpec:
        """Inventory entry of a weight (not of a `.scale`)."""
        if name not in self._weights:
            raise CheckpointError(
                f"tensor '{name}' is not part of the {self.args.arch} inventory for this config"
            )
        return self._weights[name]

    def weight_specs(self) -> Iterator[TensorSpec]:
        return iter(self._weights.values())

    def stored_nbytes(self) -> int:
        return sum(e.offsets[1] - e.offsets[0] for h in self._headers.values() for e in h.values())

    def problems(self, limit: int = 50) -> list[str]:
        """Differences between the stored tensors and the inventory: missing, unexpected, shape, dtype."""
        out: list[str] = []
        for name, spec in self._specs.items():
            shard = self._weight_map.get(name)
            if shard is None:
                if not getattr(spec, "optional", False):  # optional tensors may be absent (inventory.py)
                    out.append(f"missing tensor '{name}'")
                continue
            e = self._headers[shard][name]
            want_shape, want_dtype = self._expected(spec)
            if e.shape != want_shape:
                out.append(f"tensor '{name}' in {shard}: shape {list(e.shape)}, expected {list(want_shape)}")
            if e.dtype != want_dtype:
                out.append(f"tensor '{name}' in {shard}: dtype {e.dtype}, expected {want_dtype}")
        extra = [n for n in self._weight_map if n not in self._specs]
        out.extend(f"unexpected tensor '{n}' in {self._weight_map[n]}" for n in extra)
        if self.total_size is not None and self.total_size != self.stored_nbytes():
            out.append(
                f"{INDEX_FILE} total_size {self.total_size} != stored tensor bytes {self.stored_nbytes()}"
            )
        return out[:limit] if limit else out

    def check(self) -> None:
        """Raise `CheckpointError` listing (up to 20) problems found by `problems()`."""
        probs = self.problems(limit=0)
        if probs:
            more = f" (+{len(probs) - 20} more)" if len(probs) > 20 else ""
            raise CheckpointError(
                f"checkpoint {str(self.directory)!r} does not match its config ({len(probs)} problems){more}: "
                + "; ".join(probs[:20])
            )

    # ----------------------------------------------------------------------------------------------
    # loading
    @staticmethod
    def _expected(spec: TensorSpec | ScaleSpec) -> tuple[tuple[int, ...], str]:
        if isinstance(spec, ScaleSpec):
            return spec.shape, SAFETENSORS_DTYPE[spec.dtype]
        return spec.stored_shape, SAFETENSORS_DTYPE[spec.dtype]

    def _missing_message(self, name: str) -> str:
        if name in self._specs:
            return (
                f"tensor '{name}' is missing: the {self.args.arch} inventory expects it but {INDEX_FILE} does not list "
                "it (no shard holds it)"
            )
        return f"tensor '{name}' is not in this checkpoint (not listed in {INDEX_FILE})"

    def _handle(self, shard: str) -> Any:
        h = self._handles.get(shard)
        if h is None:
            from safetensors import safe_open

            try:
                h = safe_open(str(self.directory / shard), framework="pt", device="cpu")
            except Exception as exc:  # safetensors raises its own error types
                raise CheckpointError(f"shard {shard}: cannot open ({exc})") from None
            self._handles[shard] = h
        return h

    def load_raw(self, name: str) -> torch.Tensor:
        """The stored tensor (FP8 as float8_e4m3fn, FP4 as packed int8, scales as float8_e8m0fnu), CPU, mmapped."""
        shard = self._weight_map.get(name)
        if shard is None:
            raise CheckpointError(self._missing_message(name))
        e = self._headers[shard][name]
        spec = self._specs.get(name)
        if spec is not None:
            want_shape, want_dtype = self._expected(spec)
            if e.shape != want_shape or e.dtype != want_dtype:
                raise CheckpointError(
                    f"tensor '{name}' in {shard}: found {e.dtype} {list(e.shape)}, expected {want_dtype} "
                    f"{list(want_shape)}"
                )
        try:
            return self._handle(shard).get_tensor(name)
        except Exception as exc:
            raise CheckpointError(f"tensor '{name}' in {shard}: cannot read ({exc})") from None

    def load(
        self, name: str, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """The logical tensor: quantized weights dequantized with their `.scale`, then cast to `dtype`.

        Integer tensors (`ffn.gate.tid2eid`) are returned as int64 whatever `dtype` is.
        """
        spec = self._weights.get(name)
        raw = self.load_raw(name).to(device)
        if spec is None or spec.scale is None:
            if raw.dtype in (torch.int64, torch.int32):
                return raw.to(torch.int64)
            return raw.to(dtype)
        scale = self.load_raw(spec.scale.name).to(device)
        if spec.dtype == "fp4_e2m1x2":
            out = dequant_fp4(raw, scale, block=spec.scale.block[1])
        else:
            out = dequant_fp8_block(raw, scale, spec.scale.block)
        return out.to(dtype)
