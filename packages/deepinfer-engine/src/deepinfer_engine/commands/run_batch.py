"""`deepinfer run-batch`: OpenAI-batch-style JSONL in, JSONL out, one output line per input line in input order.

Input lines: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions" | "/v1/completions",
"body": {...}}. Output lines: {"id", "custom_id", "response": {"status_code": 200, "request_id", "body"},
"error": null}; a line that cannot be served (bad JSON, unknown url, invalid body or sampling values, prompt
too long, ...) gets "response": null and "error": {"code", "message", "line"} — failed lines are reported,
never dropped. All valid lines run as one batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from deepinfer_engine.config import add_engine_args

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-i", "--input-file", required=True, help="JSONL requests ('-' = stdin)")
    parser.add_argument("-o", "--output-file", required=True, help="JSONL results ('-' = stdout)")
    parser.add_argument("--default-max-tokens", type=int, default=64, help="max_tokens when a body has none")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    add_engine_args(parser)


def sampling_from_body(body: dict[str, Any], default_max_tokens: int, *, chat: bool):
    from deepinfer_engine.sampling_params import SamplingParams

    kw: dict[str, Any] = {}
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    kw["max_tokens"] = default_max_tokens if mt is None else mt
    for name in ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "seed", "n", "ignore_eos", "min_tokens"):
        if body.get(name) is not None:
            kw[name] = body[name]
    if body.get("stop") is not None and not chat:
        # chat: the recipe's parser applies `stop` to the content only (not the reasoning) and stops the sample
        kw["stop"] = body["stop"]
    if chat:
        if body.get("logprobs"):
            kw["logprobs"] = int(body.get("top_logprobs") or 0)
    elif body.get("logprobs") is not None:
        kw["logprobs"] = int(body["logprobs"])
    return SamplingParams(**kw)


def _error(line_no: int, custom_id: Any, code: str, message: str) -> dict[str, Any]:
    return {"id": f"batch_req_{line_no}", "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message, "line": line_no}}


def _usage(out) -> dict[str, int]:
    n_out = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": n_out,
            "total_tokens": len(out.prompt_token_ids) + n_out}


def _logprobs_json(co) -> dict[str, Any] | None:
    if co.logprobs is None:
        return None
    return {"content": [{"token_id": lp.token_id, "logprob": lp.logprob,
                         "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top]} for lp in co.logprobs]}


def process(llm, lines: list[str], *, default_max_tokens: int = 64, use_tqdm: bool = False) -> list[dict[str, Any]]:
    """Turn request lines into result dicts (same order; blank lines are skipped)."""
    results: list[dict[str, Any] | None] = []
    pending: list[tuple[int, int, Any, str, dict, Any]] = []  # (result index, line, custom_id, url, body, render)
    prompts: list[Any] = []
    params: list[Any] = []
    for line_no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            results.append(_error(line_no, None, "invalid_json", f"line {line_no} is not JSON: {exc}"))
            continue
        if not isinstance(obj, dict):
            results.append(_error(line_no, None, "invalid_request", "a request line must be a JSON object"))
            continue
        cid = obj.get("custom_id")
        url, body = obj.get("url"), obj.get("body")
        if url not in (CHAT_URL, COMPLETIONS_URL):
            results.append(_error(line_no, cid, "invalid_url",
                                  f"url: found {url!r}, expected {CHAT_URL!r} or {COMPLETIONS_URL!r}"))
            continue
        if not isinstance(body, dict):
            results.append(_error(line_no, cid, "invalid_request", "body: expected a JSON object"))
            continue
        try:
            sp = sampling_from_body(body, default_max_tokens, chat=url == CHAT_URL)
            if url == CHAT_URL:
                render = llm.render_chat_body(body)
                prompt = {"prompt_token_ids": render.token_ids}
            else:
                render = None
                p = body.get("prompt")
                if isinstance(p, str):
                    prompt = {"prompt_token_ids": llm.engine.encode_prompt(p), "prompt": p}
                elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
                    prompt = {"prompt_token_ids": p}
                else:
                    raise ValueError("prompt: expected a string or a list of token ids")
        except Exception as exc:  # recipe ConversionError, SamplingParamsError, ...: report the line, keep going
            results.append(_error(line_no, cid, "invalid_request", f"{type(exc).__name__}: {exc}"))
            continue
        pending.append((len(results), line_no, cid, url, body, render))
        results.append(None)
        prompts.append(prompt)
        params.append(sp)
    renders = [p[5] for p in pending]
    # admission errors (ids outside the vocabulary, logprobs too large, ...) come back as that line's error
    outs = (llm.generate_chat(renders, params, prompts=prompts, use_tqdm=use_tqdm, on_invalid="error")
            if prompts else [])
    created = int(time.time())
    for (idx, line_no, cid, url, body, _render), out in zip(pending, outs):
        if out.error is not None:
            results[idx] = _error(line_no, cid, "request_failed", out.error)
            continue
        bad = [co for co in out.outputs if co.parse_error is not None]
        if bad:
            results[idx] = _error(line_no, cid, "output_parse_failed",
                                  f"choice {bad[0].index}: {bad[0].parse_error}; raw text: {bad[0].text!r}")
            continue
        if url == CHAT_URL:
            choices = []
            for co in out.outputs:
                msg: dict[str, Any] = {"role": "assistant", "content": co.content}
                if co.reasoning_content is not None:
                    msg["reasoning_content"] = co.reasoning_content
                if co.tool_calls:
                    msg["tool_calls"] = co.tool_calls
                choices.append({"index": co.index, "message": msg, "finish_reason": co.finish_reason,
                                "logprobs": _logprobs_json(co)})
            resp = {"id": f"chatcmpl-{line_no}", "object": "chat.completion", "created": created,
                    "model": body.get("model"), "choices": choices, "usage": _usage(out)}
        else:
            resp = {"id": f"cmpl-{line_no}", "object": "text_completion", "created": created,
                    "model": body.get("model"),
                    "choices": [{"index": co.index, "text": co.text, "finish_reason": co.finish_reason,
                                 "logprobs": _logprobs_json(co)} for co in out.outputs],
                    "usage": _usage(out)}
        results[idx] = {"id": f"batch_req_{line_no}", "custom_id": cid,
                        "response": {"status_code": 200, "request_id": f"req_{line_no}", "body": resp},
                        "error": None}
    return [r for r in results if r is not None]


def run(ns: argparse.Namespace) -> int:
    from deepinfer_engine.llm import llm_from_cli

    if ns.input_file == "-":
        lines = sys.stdin.read().splitlines()
    else:
        with open(ns.input_file, encoding="utf-8") as f:
            lines = f.read().splitlines()
    llm = llm_from_cli(ns)
    results = process(llm, lines, default_max_tokens=ns.default_max_tokens, use_tqdm=ns.progress)
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results)
    if ns.output_file == "-":
        sys.stdout.write(text)
    else:
        with open(ns.output_file, "w", encoding="utf-8") as f:
            f.write(text)
    failed = sum(r["error"] is not None for r in results)
    print(f"run-batch: {len(results)} lines, {len(results) - failed} ok, {failed} failed", file=sys.stderr)
    return 0
