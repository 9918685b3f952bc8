"""The embedded default model: a tiny random V4.1-Flash checkpoint with the real tokenizer, written once by
`make_checkpoint` into the cache directory and reused afterwards.

Location: `$DEEPINFER_CACHE_DIR/default-v41-tiny-seed0`, or `~/.cache/deepinfer/default-v41-tiny-seed0` when the
variable is unset. Creation goes through a temporary sibling directory and one `os.rename`, so a crash or a
concurrent first run never leaves a half-written checkpoint in place.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

from deepinfer_engine.cache_root import CACHE_ENV, cache_root

logger = logging.getLogger(__name__)

DEFAULT_ARCH = "v41"
DEFAULT_PRESET = "tiny"
DEFAULT_SEED = 0
DEFAULT_NAME = f"default-{DEFAULT_ARCH}-{DEFAULT_PRESET}-seed{DEFAULT_SEED}"
__all__ = ["CACHE_ENV", "DEFAULT_NAME", "cache_root", "default_model_dir"]


def _complete(d: Path) -> bool:
    return (d / "config.json").is_file() and (d / "tokenizer.json").is_file() and any(d.glob("*.safetensors"))


def default_model_dir(*, create: bool = True) -> Path:
    """Path of the embedded default checkpoint, writing it first if it does not exist yet (create=True)."""
    final = cache_root() / DEFAULT_NAME
    if _complete(final) or not create:
        return final
    from deepinfer_engine.model.writer import make_checkpoint

    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{DEFAULT_NAME}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    logger.info("writing the default tiny V4.1 checkpoint to %s (once)", final)
    try:
        make_checkpoint(tmp, DEFAULT_ARCH, DEFAULT_PRESET, DEFAULT_SEED)
        if final.exists() and not _complete(final):
            shutil.rmtree(final)  # leftover of something else: writers only ever rename complete directories
        try:
            os.rename(tmp, final)
        except OSError:
            if not _complete(final):  # not a lost race with another writer: a real problem
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final
