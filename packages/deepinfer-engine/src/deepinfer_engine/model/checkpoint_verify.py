"""Deep check of a checkpoint directory (`deepinfer inspect DIR --verify`): every byte of every tensor.

Opening a checkpoint (`CheckpointReader`) reads only headers, so values that load fine but compute garbage pass
it: a NaN in a norm weight, an Inf row of the head, an E8M0 scale byte 0xFF (NaN), an FP8 e4m3 NaN code
(0x7F / 0xFF). `verify_checkpoint` streams each shard tensor by tensor from a memory map, in chunks of at most
`chunk_elems` values (memory stays bounded whatever the tensor size), and collects every problem as a
`Finding` instead of stopping at the first: config / index / header errors, inventory mismatches (missing,
shape, dtype, total_size), overlapping or out-of-file offsets, invalid small files (generation_config.json,
tokenizer.json, tokenizer_config.json), non-finite values and invalid scale codes.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer_engine.errors import CheckpointError, DeepInferError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.checkpoint import (
    INDEX_FILE,
    CheckpointReader,
    HeaderEntry,
    read_index,
    read_safetensors_header,
)
from deepinfer_engine.model.checkpoint_files import load_tokenizer, read_eos_ids

__all__ = ["Finding", "VerifyReport", "verify_checkpoint"]

# safetensors dtype -> (integer view, mask, float view for the NaN / Inf split, label of the 8-bit codes). A value
# is non-finite exactly when all bits of `mask` are set: the exponent for IEEE formats and FP8 e5m2 (Inf or NaN),
# exponent + mantissa for FP8 e4m3fn (no Inf; S.1111.111 is NaN), the whole byte for E8M0 (0xFF is NaN). Testing
# `max(v & mask) == mask` on the integer view is one pass and one reduction per chunk (4x faster than isfinite
# on bf16, measured on CPU).
_NON_FINITE: dict[str, tuple[torch.dtype, int, torch.dtype | None, str]] = {
    "BF16": (torch.int16, 0x7F80, torch.bfloat16, ""),
    "F16": (torch.int16, 0x7C00, torch.float16, ""),
    "F32": (torch.int32, 0x7F800000, torch.float32, ""),
    "F64": (torch.int64, 0x7FF0000000000000, torch.float64, ""),
    "F8_E4M3": (torch.uint8, 0x7F, None, "NaN code 0x7F/0xFF of FP8 e4m3"),
    "F8_E5M2": (torch.uint8, 0x7C, None, "Inf/NaN code of FP8 e5m2"),
    "F8_E8M0": (torch.uint8, 0xFF, None, "NaN code 0xFF of E8M0"),
}


@dataclass(frozen=True)
class Finding:
    """One problem: `kind` (config | index | header | inventory | file | non_finite | invalid_scale), the file
    it is in (relative to the checkpoint directory), the tensor if any, and a message saying what was found."""

    kind: str
    file: str
    tensor: str | None
    message: str


@dataclass(frozen=True)
class VerifyReport:
    directory: str
    findings: tuple[Finding, ...]
    tensors_checked: int
    bytes_checked: int

    @property
    def ok(self) -> bool:
        return not self.findings

    def to_json(self) -> dict[str, Any]:
        return {"directory": self.directory, "ok": self.ok, "tensors_checked": self.tensors_checked,
                "bytes_checked": self.bytes_checked, "findings": [asdict(f) for f in self.findings]}


def verify_checkpoint(
    directory: str | os.PathLike[str], *, progress: bool = False, chunk_elems: int = 1 << 24
) -> VerifyReport:
    """Check everything in `directory`; never raises for a problem of the checkpoint (it becomes a Finding)."""
    d = Path(directory)
    findings: list[Finding] = []

    def add(kind: str, file: str, message: str, tensor: str | None = None) -> None:
        f = Finding(kind, file, tensor, message)
        if f not in findings:
            findings.append(f)

    args: ModelArgs | None = None
    try:
        args = ModelArgs.from_checkpoint_dir(d)
    except DeepInferError as exc:
        add("config", "config.json", str(exc))
    try:
        weight_map, _ = _index(d)
    except DeepInferError as exc:
        add("index", INDEX_FILE, str(exc))
        return VerifyReport(str(d), tuple(findings), 0, 0)
    if args is not None:
        for kind, file, message in _small_file_problems(d, args):
            add(kind, file, message)
    # headers first: their errors are findings, and the survivors give the progress bar its total
    headers: dict[str, tuple[dict[str, HeaderEntry], int]] = {}
    for shard in sorted(set(weight_map.values())):
        path = d / shard
        if not path.is_file():
            add("header", shard, f"shard {shard} is listed in {INDEX_FILE} but missing from the directory")
            continue
        try:
            entries, _ = read_safetensors_header(path)
        except DeepInferError as exc:
            add("header", shard, str(exc))
            continue
        headers[shard] = (entries, _data_start(path))
    if args is not None and len(headers) == len(set(weight_map.values())):
        try:
            with CheckpointReader(d, args) as reader:
                for p in reader.problems(limit=0):
                    add("inventory", INDEX_FILE, p)
        except DeepInferError as exc:
            add("inventory", INDEX_FILE, str(exc))
    total = sum(e.offsets[1] - e.offsets[0] for entries, _ in headers.values() for e in entries.values())
    from tqdm.auto import tqdm

    n_tensors = n_bytes = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc="verify", disable=not progress, dynamic_ncols=True) as bar:
        for shard, (entries, start) in headers.items():
            bar.set_postfix_str(shard, refresh=False)
            for name, entry, message in _scan_shard(d / shard, entries, start, chunk_elems, bar.update):
                add("invalid_scale" if _is_scale(name, entry) else "non_finite", shard,
                    f"tensor '{name}' in {shard}: {message}", name)
            n_tensors += len(entries)
            n_bytes += sum(e.offsets[1] - e.offsets[0] for e in entries.values())
    return VerifyReport(str(d), tuple(findings), n_tensors, n_bytes)


def _index(d: Path) -> tuple[dict[str, str], int | None]:
    path = d / INDEX_FILE
    if not path.is_file():
        raise CheckpointError(f"no {INDEX_FILE} in {str(d)!r}; expected the official sharded layout")
    return read_index(path)


def _small_file_problems(d: Path, args: ModelArgs) -> Iterator[tuple[str, str, str]]:
    try:
        read_eos_ids(d, args)
    except DeepInferError as exc:
        yield "file", "generation_config.json", str(exc)
    try:
        load_tokenizer(d, required=False)
    except DeepInferError as exc:
        yield "file", "tokenizer.json", str(exc)


def _data_start(path: Path) -> int:
    with path.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


def _is_scale(name: str, entry: HeaderEntry) -> bool:
    return name.endswith(".scale") or entry.dtype == "F8_E8M0"


def _scan_shard(path: Path, entries: dict[str, HeaderEntry], start: int, chunk_elems: int, advance
                ) -> Iterator[tuple[str, HeaderEntry, str]]:
    """(name, entry, message) for every tensor of the shard holding a non-finite value or invalid code."""
    with path.open("rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return
        # copy-on-write map: torch wants a writable buffer, nothing is ever written, so no page is copied
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        try:
            for name, entry in sorted(entries.items(), key=lambda kv: kv[1].offsets[0]):
                message = _scan_tensor(mm, entry, start, chunk_elems, advance)
                if message is not None:
                    yield name, entry, message
        finally:
            mm.close()


def _scan_tensor(mm: mmap.mmap, e: HeaderEntry, start: int, chunk_elems: int, advance) -> str | None:
    begin, end = e.offsets
    nbytes = end - begin
    if e.dtype not in _NON_FINITE:  # integer / packed FP4 tensors: every bit pattern is a valid value
        advance(nbytes)
        return None
    view, mask, float_dtype, label = _NON_FINITE[e.dtype]
    item = torch.empty((), dtype=view).element_size()
    numel = nbytes // item
    n_nan = n_inf = 0
    first: int | None = None
    for lo in range(0, numel, chunk_elems):
        count = min(chunk_elems, numel - lo)
        t = torch.frombuffer(mm, dtype=view, count=count, offset=start + begin + lo * item)
        bits = torch.bitwise_and(t, mask)
        if int(bits.max()) == mask:  # rare: count, and find the first one
            bad = bits == mask
            if float_dtype is None:
                n_nan += int(bad.sum())
            else:
                inf = int(torch.isinf(t.view(float_dtype)).sum())
                n_inf += inf
                n_nan += int(bad.sum()) - inf
            if first is None:
                first = lo + int(bad.nonzero()[0, 0])
            del bad
        del t, bits
        advance(count * item)
    if first is None:
        return None
    where = _unravel(first, e.shape)
    if float_dtype is not None:
        return f"{n_nan} NaN and {n_inf} Inf among {numel} {e.dtype} values (first at {where}); expected finite"
    return f"{n_nan} {label} among {numel} values (first at {where}); expected finite values"


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for s in reversed(shape):
        out.append(flat % s if s else 0)
        flat = flat // s if s else 0
    return out[::-1]
