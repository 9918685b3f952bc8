"""Test helpers shared by the packages' test suites: tiny random checkpoints in the official format."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["make_tiny_checkpoint"]


def make_tiny_checkpoint(
    path: str | os.PathLike[str],
    *,
    arch: str = "v41",
    seed: int = 0,
    preset: str = "tiny",
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a tiny random checkpoint (config.json, index, shards, tokenizer files) into `path`; return it.

    `preset`: "tiny" (docs/testing.md §9 shapes, real 129,280-token vocabulary) or "tiny-dspark" (arch v4 only).
    About 40 MB; takes ~1-2 s on CPU. Share one per test session (e.g. a session-scoped fixture).
    """
    from deepinfer_engine.model.writer import make_checkpoint

    return make_checkpoint(path, arch, preset, seed, max_shard_bytes=max_shard_bytes)


def unguard_moe(monkeypatch) -> None:
    """Run every `MoE.forward` with CUDA sync-debug mode off (restored after): tests that guard a decode step with
    `set_sync_debug_mode("error")` exempt the MoE layers (the whole-step tests count their synchronizations)."""
    import torch
    from deepinfer_engine.model import moe

    forward = moe.MoE.forward

    def unguarded(self, *args, **kw):
        mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode(0)
        try:
            return forward(self, *args, **kw)
        finally:
            torch.cuda.set_sync_debug_mode(mode)

    monkeypatch.setattr(moe.MoE, "forward", unguarded)
