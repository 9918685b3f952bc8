"""`deepinfer make-checkpoint`: write a random checkpoint in the official release format."""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", choices=["v41", "v4"], default="v41", help="architecture (default v41)")
    parser.add_argument(
        "--preset",
        default="tiny",
        help="tiny (docs/testing.md §9 shapes, real vocabulary), tiny-dspark (v4 with 3 DSpark stages), "
        "layers-N (real widths, N layers), full (the released size)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--out", required=True, type=Path, help="output directory (created)")
    parser.add_argument(
        "--max-shard-bytes",
        type=int,
        default=None,
        help="split shards at this many bytes (default 10 MB below 1 GB total, else 4 GB)",
    )
    parser.add_argument(
        "--n-routed-experts", type=int, default=None,
        help="override the routed-expert count (top-k clipped to it): a real-width slice in less time and disk",
    )
    parser.add_argument(
        "--device", default="cpu",
        help="where random values are drawn and quantized (cuda: real-width slices become disk-bound)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="write into a directory that holds a checkpoint"
    )


def run(ns: argparse.Namespace) -> int:
    from deepinfer_engine.model.checkpoint import CheckpointReader
    from deepinfer_engine.model.writer import make_checkpoint

    out = make_checkpoint(
        ns.out, ns.arch, ns.preset, ns.seed, max_shard_bytes=ns.max_shard_bytes, overwrite=ns.overwrite,
        n_routed_experts=ns.n_routed_experts, device=ns.device,
    )
    with CheckpointReader(out) as reader:
        names = reader.tensor_names()
        shards = len({reader.shard_of(n) for n in names})
        total = reader.total_size
    print(f"wrote {out}: arch {ns.arch}, preset {ns.preset}, seed {ns.seed}")
    print(f"  {len(names):,} tensors in {shards} shards, {total:,} bytes")
    return 0
