"""OpenAI Completions / Chat Completions bodies <-> engine requests and results, shared by `deepinfer run-batch`
(batch files) and `deepinfer serve` (HTTP): what a body asks for (`prepare`), the response body of a finished
request (`response_body`), the streamed chunks of one (`completion_chunk`, `chat_chunk`).

A chat body is rendered by deepseek-recipe for this model (`LLM.render_chat_body`) and its samples are parsed by
the recipe into content / reasoning_content / tool_calls; a completions body is a prompt string or token ids.
Unknown fields are ignored, as OpenAI-compatible servers do, but known fields the engine cannot honour are
refused rather than silently dropped; invalid values raise (recipe ConversionError, SamplingParamsError,
ValueError), which callers report as the request's error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = [
    "CHAT_URL",
    "COMPLETIONS_URL",
    "Prepared",
    "chat_chunk",
    "completion_chunk",
    "logprobs_json",
    "output_failure",
    "prepare",
    "response_body",
    "sampling_from_body",
    "usage",
]

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"


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


@dataclass
class Prepared:
    """A body that passed the protocol checks: its prompt (a prompt dict for the engine), sampling parameters
    (for chat, `render.sampling(params)` is what the engine runs) and, for chat, the recipe rendering whose
    parsing options parse the samples."""

    url: str
    body: dict[str, Any]
    prompt: dict[str, Any]
    params: Any
    render: Any = None


def _unsupported(body: dict[str, Any], chat: bool) -> str | None:
    """The first field that asks for something this engine does not do (so it is refused, not silently
    ignored), as an error message, else None."""
    if body.get("logit_bias"):
        return "logit_bias: not supported; drop it"
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        return f"response_format: found {fmt!r}, only {{'type': 'text'}} is supported (no constrained decoding)"
    if chat:
        return None
    if body.get("echo"):
        return "echo: not supported; drop it (the prompt is the request's own)"
    if body.get("suffix"):
        return "suffix: not supported (no fill-in-the-middle); drop it"
    best_of, n = body.get("best_of"), body.get("n") or 1
    if best_of is not None and best_of != n:
        return f"best_of: found {best_of!r}, only best_of == n ({n}) is supported; drop it or sample n and rank"
    return None


def prepare(llm, url: str, body: dict[str, Any], default_max_tokens: int) -> Prepared:
    """Check and translate one request body (raises on an invalid one; nothing is queued). Unknown fields are
    ignored; known ones this engine cannot honour (`logit_bias`, a non-text `response_format`, `echo`, `suffix`,
    `best_of` != n) are refused."""
    if not isinstance(body, dict):
        raise ValueError("body: expected a JSON object")
    if url not in (CHAT_URL, COMPLETIONS_URL):
        raise ValueError(f"url: found {url!r}, expected {CHAT_URL!r} or {COMPLETIONS_URL!r}")
    why = _unsupported(body, url == CHAT_URL)
    if why is not None:
        raise ValueError(why)
    sp = sampling_from_body(body, default_max_tokens, chat=url == CHAT_URL)
    if url == CHAT_URL:
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ValueError(f"messages: found {type(msgs).__name__}, expected a non-empty list of message "
                             "objects ({'role': ..., 'content': ...})")
        render = llm.render_chat_body(body)
        return Prepared(url, body, {"prompt_token_ids": render.token_ids}, sp, render)
    p = body.get("prompt")
    if isinstance(p, str):
        prompt = {"prompt_token_ids": llm.engine.encode_prompt(p), "prompt": p}
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        prompt = {"prompt_token_ids": p}
    else:
        raise ValueError("prompt: expected a string or a non-empty list of token ids")
    return Prepared(url, body, prompt, sp)


def usage(out) -> dict[str, int]:
    n_out = sum(len(c.token_ids) for c in out.outputs)
    return {"prompt_tokens": len(out.prompt_token_ids), "completion_tokens": n_out,
            "total_tokens": len(out.prompt_token_ids) + n_out}


def logprobs_json(co) -> dict[str, Any] | None:
    if co.logprobs is None:
        return None
    return {"content": [{"token_id": lp.token_id, "logprob": lp.logprob,
                         "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top]} for lp in co.logprobs]}


def output_failure(out) -> tuple[str, str] | None:
    """Why a finished output is not a result, as (code, message): "request_failed" with the engine's error (the
    request could not be served, its logits turned non-finite, its step failed), "output_parse_failed" when the
    recipe could not parse a chat sample (the message carries the raw text); None for a result."""
    if out.error is not None:
        return "request_failed", out.error
    bad = [co for co in out.outputs if co.parse_error is not None]
    if bad:
        return "output_parse_failed", f"choice {bad[0].index}: {bad[0].parse_error}; raw text: {bad[0].text!r}"
    return None


def response_body(url: str, body: dict[str, Any], out, response_id: str, created: int) -> dict[str, Any]:
    """The OpenAI response body of a finished, successful request (the caller handles `out.error` and samples
    whose `parse_error` is set)."""
    if url == CHAT_URL:
        choices = []
        for co in out.outputs:
            msg: dict[str, Any] = {"role": "assistant", "content": co.content}
            if co.reasoning_content is not None:
                msg["reasoning_content"] = co.reasoning_content
            finish = co.finish_reason
            if co.tool_calls:
                msg["tool_calls"] = co.tool_calls
                # the protocol's reason for a reply that ends in calls (the recipe's stream parser says the same)
                finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": co.index, "message": msg, "finish_reason": finish,
                            "logprobs": logprobs_json(co)})
        return {"id": response_id, "object": "chat.completion", "created": created, "model": body.get("model"),
                "choices": choices, "usage": usage(out)}
    return {"id": response_id, "object": "text_completion", "created": created, "model": body.get("model"),
            "choices": [{"index": co.index, "text": co.text, "finish_reason": co.finish_reason,
                         "logprobs": logprobs_json(co)} for co in out.outputs],
            "usage": usage(out)}


def completion_chunk(body: dict[str, Any], response_id: str, created: int, index: int, text: str,
                     finish_reason: str | None) -> dict[str, Any]:
    """One streamed Completions chunk: new text of sample `index` (and its finish reason once finished)."""
    return {"id": response_id, "object": "text_completion", "created": created, "model": body.get("model"),
            "choices": [{"index": index, "text": text, "finish_reason": finish_reason, "logprobs": None}]}


def chat_chunk(body: dict[str, Any], response_id: str, created: int, index: int, delta: dict[str, Any],
               finish_reason: str | None = None) -> dict[str, Any]:
    """One streamed Chat Completions chunk: `delta` of sample `index` (role, content, reasoning_content or
    tool_calls), or its finish reason with an empty delta."""
    return {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": body.get("model"),
            "choices": [{"index": index, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]}
