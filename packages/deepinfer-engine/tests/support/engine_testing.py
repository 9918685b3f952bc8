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


def script_replies(llm, monkeypatch, scripts: list[list[int]]) -> list[list[int]]:
    """Replace an LLM's sampled ids request by request (in arrival order) with `scripts`, so a test's expected
    text comes from the script rather than from the code under test; returns the prompts the engine admitted."""
    prompts: list[list[int]] = []
    order: dict[str, list[int]] = {}
    counts: dict[str, int] = {}
    runner, eng = llm.engine.runner, llm.engine
    real_execute, real_add = runner.execute, eng.add_processed

    def add_processed(rid, req, **kw):
        prompts.append(list(req.prompt_token_ids))
        return real_add(rid, req, **kw)

    def execute(sched):
        res = real_execute(sched)
        for rid in list(res.sampled_token_ids):
            if rid not in order:
                order[rid] = scripts[len(order)]
            script = order[rid]
            k = counts.get(rid, 0)
            res.sampled_token_ids[rid] = script[k]
            counts[rid] = k + 1
        return res

    monkeypatch.setattr(runner, "execute", execute)
    monkeypatch.setattr(eng, "add_processed", add_processed)
    return prompts


def plain_ids(llm, text: str) -> list[int]:
    """`text` as token ids without special tokens."""
    return llm.tokenizer.encode(text, add_special_tokens=False).ids
