"""`deepinfer chat`: interactive chat through the model's chat template, streaming the reply as it is generated.
Commands: /reset clears the history, /exit (or end of input) quits."""

from __future__ import annotations

import argparse
import sys

from deepinfer_engine.config import add_engine_args
from deepinfer_engine.sampling_params import add_sampling_args, sampling_params_from_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False, help="thinking mode")
    add_sampling_args(parser, defaults={"max_tokens": 128, "temperature": 0.7})
    add_engine_args(parser)


def chat_turn(llm, history: list[dict], sp, *, thinking: bool, request_id: str, out=None):
    """Generate one assistant reply for `history`, writing text to `out` as tokens arrive; returns the output."""
    out = out if out is not None else sys.stdout
    rendered = llm.render_chat(history, thinking=thinking)
    eng = llm.engine
    eng.add_request(request_id, rendered.token_ids, rendered.sampling(sp))
    printed = 0
    final = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.request_id != request_id:
                continue
            text = o.outputs[0].text
            if len(text) > printed:
                out.write(text[printed:])
                out.flush()
                printed = len(text)
            if o.finished:
                final = o
    out.write("\n")
    rendered.parse_into(final.outputs[0], llm._recipe_tokenizer())
    return final


def run(ns: argparse.Namespace) -> int:
    from deepinfer_engine.llm import llm_from_cli

    llm = llm_from_cli(ns)
    sp = sampling_params_from_cli(ns)
    base = [{"role": "system", "content": ns.system}] if ns.system else []
    history = list(base)
    interactive = sys.stdin.isatty()
    turn = 0
    while True:
        try:
            line = input("user> " if interactive else "")
        except EOFError:
            break
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            history = list(base)
            continue
        if not cmd:
            continue
        history.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        out = chat_turn(llm, history, sp, thinking=ns.thinking, request_id=f"chat-{turn}")
        turn += 1
        co = out.outputs[0]
        if out.error:
            print(f"[error: {out.error}]", file=sys.stderr)
        history.append({"role": "assistant", "content": co.content or ""})
    return 0
