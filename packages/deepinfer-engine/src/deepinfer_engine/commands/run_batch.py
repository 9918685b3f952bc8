"""`deepinfer run-batch`: OpenAI-batch-style JSONL in, JSONL out, one output line per input line in input order.

Input lines: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}. Output lines: {"id", "custom_id", "response": {"status_code": 200, "request_id", "body"},
"error": null}; a line that cannot be served (not UTF-8, bad JSON, a custom_id used before, a method other than
POST, unknown url, invalid body or sampling values, prompt too long, ...) gets "response": null and
"error": {"code", "message", "line"} -- failed lines are reported, never dropped.

The output file is opened before the model loads. Valid lines run in waves (`--wave-size`, default
4 x max_num_seqs); each result is written and flushed as soon as it and every earlier line's result are known,
so the results of completed waves are on disk even if the run dies later.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from deepinfer_engine.config import add_engine_args
from deepinfer_engine.openai_api import CHAT_URL, COMPLETIONS_URL, output_failure, prepare, response_body


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="JSONL requests ('-' = stdin)")
    parser.add_argument("-o", "--output-file", required=True, help="JSONL results ('-' = stdout)")
    parser.add_argument("--default-max-tokens", type=int, default=64, help="max_tokens when a body has none")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--wave-size", type=int, default=None,
                        help="run valid lines in waves of this many requests; each wave's results are on disk as "
                             "soon as it completes (default: 4 x max_num_seqs)")
    add_engine_args(parser)


def _error(line_no: int, custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{line_no}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message, "line": line_no}}


@dataclass
class _Request:
    """A line that passed validation: what to generate and what the result line needs."""

    line_no: int
    custom_id: Any
    url: str
    body: dict[str, Any]
    render: Any
    prompt: dict[str, Any]
    params: Any
    result: dict[str, Any] | None = None


def _parse_line(llm, line_no: int, raw: str | bytes, seen: dict[str, int], default_max_tokens: int
                ) -> _Request | dict[str, Any] | None:
    """A valid request, an error result for the line, or None for a blank line."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            return _error(line_no, None, "invalid_encoding",
                          f"line {line_no} is not UTF-8 text: byte {exc.start} ({exc.reason})")
    if line_no == 1:
        raw = raw.removeprefix("\ufeff")
    if not raw.strip():
        return None
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, RecursionError) as exc:
        return _error(line_no, None, "invalid_json", f"line {line_no} is not JSON: {exc}")
    if not isinstance(obj, dict):
        return _error(line_no, None, "invalid_request", "a request line must be a JSON object")
    cid = obj.get("custom_id")
    if cid is not None and not isinstance(cid, str):
        return _error(line_no, None, "invalid_request", f"custom_id: found {cid!r}, expected a string")
    if cid is not None:
        if cid in seen:
            return _error(line_no, cid, "duplicate_custom_id",
                          f"custom_id {cid!r} is already used by line {seen[cid]}; expected unique custom_ids")
        seen[cid] = line_no
    method = obj.get("method", "POST")
    if method != "POST":
        return _error(line_no, cid, "invalid_method", f"method: found {method!r}, expected 'POST'")
    url, body = obj.get("url"), obj.get("body")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        return _error(line_no, cid, "invalid_url", f"url: found {url!r}, expected {CHAT_URL!r} or {COMPLETIONS_URL!r}")
    if not isinstance(body, dict):
        return _error(line_no, cid, "invalid_request", "body: expected a JSON object")
    try:
        req = prepare(llm, url, body, default_max_tokens)
    except Exception as exc:  # recipe ConversionError, SamplingParamsError, ...: report the line, keep going
        return _error(line_no, cid, "invalid_request", f"{type(exc).__name__}: {exc}")
    return _Request(line_no, cid, url, body, req.render, req.prompt, req.params)


def _result(req: _Request, out, created: int) -> dict[str, Any]:
    line_no, cid, body = req.line_no, req.custom_id, req.body
    failure = output_failure(out)
    if failure is not None:
        return _error(line_no, cid, *failure)
    prefix = "chatcmpl" if req.url == CHAT_URL else "cmpl"
    resp = response_body(req.url, body, out, f"{prefix}-{line_no}", created)
    return {"id": f"batch_req_{line_no}", "custom_id": cid,
            "response": {"status_code": 200, "request_id": f"req_{line_no}", "body": resp}, "error": None}


def _run_wave(llm, wave: list[_Request], *, use_tqdm: bool) -> None:
    """Generate `wave` as one batch and set each request's result; a request the engine refuses at admission
    (ids outside the vocabulary, logprobs too large, ...) comes back as that line's error, the rest run."""
    created = int(time.time())
    outs = llm.generate_chat([r.render for r in wave], [r.params for r in wave], prompts=[r.prompt for r in wave],
                             use_tqdm=use_tqdm, on_invalid="error")
    for req, out in zip(wave, outs):
        req.result = _result(req, out, created)


def process(llm, lines: Iterable[str | bytes], *, default_max_tokens: int = 64, use_tqdm: bool = False,
            wave_size: int | None = None, on_result: Callable[[dict[str, Any]], None] | None = None
            ) -> list[dict[str, Any]]:
    """Turn request lines (str, or bytes decoded here: invalid UTF-8 fails only its line) into result dicts, in
    input order; blank lines are skipped.

    Valid requests run in waves of `wave_size` (default: all at once). `on_result(result)` is called for each
    result as soon as it and every earlier line's result are known: failed lines before the first wave
    starts, each wave's lines when the wave completes, so a run that dies later keeps them.
    """
    seen: dict[str, int] = {}
    entries: list[_Request | dict[str, Any]] = []
    for line_no, raw in enumerate(lines, start=1):
        item = _parse_line(llm, line_no, raw, seen, default_max_tokens)
        if item is not None:
            entries.append(item)
    done: list[dict[str, Any]] = []

    def emit() -> None:
        while len(done) < len(entries):
            e = entries[len(done)]
            r = e.result if isinstance(e, _Request) else e
            if r is None:
                return
            done.append(r)
            if on_result is not None:
                on_result(r)

    pending = [e for e in entries if isinstance(e, _Request)]
    size = wave_size or max(len(pending), 1)
    emit()
    for lo in range(0, len(pending), size):
        _run_wave(llm, pending[lo:lo + size], use_tqdm=use_tqdm)
        emit()
    return done


def _dumps(result: dict[str, Any]) -> str:
    text = json.dumps(result, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a "\ud800" escape in the input: keep it escaped
        text = json.dumps(result)
    return text + "\n"


def _read_input(name: str) -> list[bytes]:
    from deepinfer_engine.errors import ConfigError

    if name == "-":
        return sys.stdin.buffer.read().splitlines()
    try:
        with open(name, "rb") as f:
            return f.read().splitlines()
    except OSError as exc:
        raise ConfigError(f"input_file: cannot read {name!r} ({exc.strerror or exc}); expected a JSONL file") from None


def run(ns: argparse.Namespace) -> int:
    from deepinfer_engine.commands.output_file import open_output
    from deepinfer_engine.errors import ConfigError
    from deepinfer_engine.llm import llm_from_cli

    if ns.wave_size is not None and ns.wave_size < 1:
        raise ConfigError(f"wave_size: found {ns.wave_size}, expected >= 1")
    lines = _read_input(ns.input_file)
    # the output is opened before the model loads: a bad path fails in a second, not after the whole batch
    out = open_output(ns.output_file, option="output_file")
    n_ok = n_failed = 0
    try:
        llm = llm_from_cli(ns)

        def write(result: dict[str, Any]) -> None:
            nonlocal n_ok, n_failed
            out.write(_dumps(result))
            out.flush()
            n_failed += result["error"] is not None
            n_ok += result["error"] is None

        wave = ns.wave_size or 4 * llm.config.scheduler.max_num_seqs
        process(llm, lines, default_max_tokens=ns.default_max_tokens, use_tqdm=ns.progress, wave_size=wave,
                on_result=write)
    finally:
        if out is not sys.stdout:
            out.close()
    print(f"run-batch: {n_ok + n_failed} lines, {n_ok} ok, {n_failed} failed", file=sys.stderr)
    return 0
