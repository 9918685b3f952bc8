"""The small files next to a checkpoint's weights, read and validated once at load.

`generation_config.json` (EOS ids), `tokenizer.json` and `tokenizer_config.json`. A malformed file is a typed
error naming the file and the field, raised at load rather than as a confusing failure mid-generation:
`CheckpointError` for a file of the checkpoint directory, `ConfigError` for a file the user named explicitly
(the `tokenizer` engine option).
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from deepinfer_engine.errors import CheckpointError, ConfigError

__all__ = ["GENERATION_CONFIG_FILE", "load_tokenizer", "read_eos_ids", "read_json_object"]

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"

# generation_config.json fields whose type the engine can check (others are HF options it ignores)
_TOKEN_ID_FIELDS = ("bos_token_id", "pad_token_id", "decoder_start_token_id")
_FLOAT_FIELDS = {"temperature": (0.0, None), "top_p": (0.0, 1.0), "repetition_penalty": (0.0, None)}
_INT_FIELDS = ("top_k", "max_length", "max_new_tokens", "min_length", "min_new_tokens")
_BOOL_FIELDS = ("do_sample",)
# tokenizer_config.json fields
_SPECIAL_TOKEN_FIELDS = ("bos_token", "eos_token", "pad_token", "unk_token")
_TOKCFG_BOOL_FIELDS = ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "legacy")


def read_json_object(path: Path, *, error: type[Exception] = CheckpointError) -> dict[str, Any]:
    """Parse `path` as a JSON object; anything else (unreadable, not UTF-8, not JSON, not an object) is `error`."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise error(f"{path}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise error(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start}); expected a JSON file") from None
    except (json.JSONDecodeError, RecursionError) as exc:
        raise error(f"{path}: not valid JSON ({exc}); expected a JSON object") from None
    if not isinstance(data, dict):
        raise error(f"{path}: found a JSON {type(data).__name__}, expected an object")
    return data


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _field_error(path: Path, field: str, found: object, expected: str) -> CheckpointError:
    return CheckpointError(
        f"{path.name} in {str(path.parent)!r}: field '{field}' is {_short(found)}; expected {expected}"
    )


def _token_id(path: Path, field: str, value: object, vocab: int | None) -> int:
    if not _is_int(value) or value < 0 or (vocab is not None and value >= vocab):
        bound = f"[0, {vocab})" if vocab is not None else "[0, vocab_size)"
        raise _field_error(path, field, value, f"a token id (integer in {bound})")
    return value


def read_eos_ids(model_dir: Path, args: Any) -> list[int]:
    """EOS token ids of a checkpoint: `generation_config.json`'s `eos_token_id` (an id or a list of ids), else
    `args.eos_token_id`, else [1]. The file's typed fields are validated (ids against `args.vocab_size`)."""
    vocab = getattr(args, "vocab_size", None)
    vocab = int(vocab) if vocab is not None else None
    ids: list[int] = []
    path = Path(model_dir) / GENERATION_CONFIG_FILE
    if path.exists():
        gen = read_json_object(path)
        eos = gen.get("eos_token_id")
        if isinstance(eos, list):
            ids = [_token_id(path, f"eos_token_id[{i}]", e, vocab) for i, e in enumerate(eos)]
        elif eos is not None:
            if not _is_int(eos):
                raise _field_error(path, "eos_token_id", eos, "a token id or a list of token ids")
            ids = [_token_id(path, "eos_token_id", eos, vocab)]
        _check_generation_fields(path, gen, vocab)
    if not ids and getattr(args, "eos_token_id", None) is not None:
        ids = [int(args.eos_token_id)]
    return ids or [1]


def _check_generation_fields(path: Path, gen: dict[str, Any], vocab: int | None) -> None:
    for name in _TOKEN_ID_FIELDS:
        value = gen.get(name)
        if isinstance(value, list):  # HF allows a list for pad ids too
            for i, v in enumerate(value):
                _token_id(path, f"{name}[{i}]", v, vocab)
        elif value is not None:
            _token_id(path, name, value, vocab)
    for name, (lo, hi) in _FLOAT_FIELDS.items():
        value = gen.get(name)
        if value is None:
            continue
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ok = ok and value >= lo and (hi is None or value <= hi)
        if not ok:
            rng = f"[{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
            raise _field_error(path, name, value, f"a finite number {rng}")
    for name in _INT_FIELDS:
        value = gen.get(name)
        if value is not None and (not _is_int(value) or value < 0):
            raise _field_error(path, name, value, "a non-negative integer")
    for name in _BOOL_FIELDS:
        value = gen.get(name)
        if value is not None and not isinstance(value, bool):
            raise _field_error(path, name, value, "true or false")


def load_tokenizer(path: str | Path, *, required: bool = True) -> Any:
    """A `tokenizers.Tokenizer` from `tokenizer.json` (or a directory holding one), validated.

    `required` (an explicitly given tokenizer): a missing file is a `ConfigError`. Otherwise (the checkpoint
    directory's own tokenizer) a missing file logs a warning and returns None: text prompts and
    detokenization are then off. An unparsable `tokenizer.json`, or a `tokenizer_config.json` beside it with
    malformed fields or special tokens the tokenizer lacks, is a `ConfigError` (given path) or a
    `CheckpointError` (checkpoint directory).
    """
    path = Path(path)
    file = path / TOKENIZER_FILE if path.is_dir() else path
    error: type[Exception] = ConfigError if required else CheckpointError
    if not file.is_file():
        if required:
            what = "a directory without tokenizer.json" if path.is_dir() else "no such file"
            raise ConfigError(f"tokenizer: {str(path)!r} is {what}; expected a tokenizer.json file or its directory")
        logger.warning("no tokenizer at %s: text prompts and detokenization are off", file)
        return None
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{file}: cannot read ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:
        raise error(f"{file}: not UTF-8 text ({exc.reason} at byte {exc.start}); expected a tokenizer.json") from None
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(text)
    except Exception as exc:  # the Rust parser raises a bare Exception with a serde message (line, column)
        raise error(f"{file}: not a valid tokenizer.json ({exc})") from None
    if tok.get_vocab_size(with_added_tokens=True) == 0:
        raise error(f"{file}: the tokenizer has an empty vocabulary")
    cfg = file.parent / TOKENIZER_CONFIG_FILE
    if cfg.is_file():
        _check_tokenizer_config(cfg, tok, error)
    return tok


def _check_tokenizer_config(path: Path, tok: Any, error: type[Exception]) -> None:
    cfg = read_json_object(path, error=error)

    def fail(field: str, found: object, expected: str) -> Exception:
        return error(f"{path}: field '{field}' is {_short(found)}; expected {expected}")

    for name in _SPECIAL_TOKEN_FIELDS:
        value = cfg.get(name)
        if value is None:
            continue
        content = value.get("content") if isinstance(value, dict) else value
        if not isinstance(content, str) or not content:
            raise fail(name, value, "null, a token string or an object with a string 'content'")
        if tok.token_to_id(content) is None:
            raise fail(name, content, f"a token of {path.parent / TOKENIZER_FILE}")
    for name in _TOKCFG_BOOL_FIELDS:
        value = cfg.get(name)
        if value is not None and not isinstance(value, bool):
            raise fail(name, value, "true or false")
    value = cfg.get("model_max_length")
    # HF writes a huge float sentinel (1e30) when the length is unknown: any positive number is accepted
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0):
        raise fail("model_max_length", value, "a positive number")
