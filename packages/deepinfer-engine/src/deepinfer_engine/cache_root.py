"""Where deepinfer keeps what it builds once and reuses: `$DEEPINFER_CACHE_DIR`, else `~/.cache/deepinfer`
(the embedded default checkpoint, Engram token maps)."""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "DEEPINFER_CACHE_DIR"


def cache_root() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "deepinfer"
