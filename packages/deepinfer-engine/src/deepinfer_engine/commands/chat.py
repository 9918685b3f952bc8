"""`deepinfer chat`: interactive chat through the model's chat template (deepseek-recipe), streamed.

Every reply is parsed while it is generated: the recipe's StreamProcessor gets the new token ids after each
engine step, and its reasoning / content deltas are printed as they arrive (reasoning between `[thinking]` and
`[/thinking]`, dimmed on a terminal), tool calls once complete, and the finish reason at the end. Special
tokens are recognised by id and never printed. The parsed assistant message (content, reasoning, tool calls)
joins the history and is re-rendered by the recipe in the next turn's prompt.
If the recipe cannot parse a reply, the raw text is printed after a warning naming the problem.

Commands: /reset clears the history, /exit (or end of input) quits.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

from deepinfer_engine.config import add_engine_args
from deepinfer_engine.sampling_params import add_sampling_args, sampling_params_from_cli

_DIM, _RESET = "\x1b[2m", "\x1b[0m"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--system", help="system prompt (default: none)")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                        help="thinking mode: the reply starts with reasoning (default: off)")
    parser.add_argument("--color", action=argparse.BooleanOptionalAction, default=None,
                        help="dim the reasoning with ANSI codes (default: when stdout is a terminal)")
    add_sampling_args(parser, defaults={"max_tokens": 128, "temperature": 0.7})
    add_engine_args(parser)


class TurnPrinter:
    """`on_delta` callback of `LLM.chat` for one reply: writes each ChatDelta to `out` as it arrives."""

    def __init__(self, out: TextIO, *, color: bool) -> None:
        self.out = out
        self.color = color
        self._in_reasoning = False
        self._at_line_start = True

    def __call__(self, conversation: int, sample: int, delta: Any) -> None:
        if delta.kind == "reasoning":
            if not self._in_reasoning:
                self._write((_DIM if self.color else "") + "[thinking] ")
                self._in_reasoning = True
            self._write(delta.text)
        elif delta.kind == "content":
            self._end_reasoning()
            self._write(delta.text)
        elif delta.kind == "tool_call":
            self._end_reasoning()
            fn = delta.tool_call["function"]
            self._line(f"[tool call {delta.tool_call.get('id', '')}] {fn['name']}({fn['arguments']})")
        elif delta.kind == "finish":
            self._end_reasoning()
            hidden = f"; {delta.num_hidden} special token(s) not shown" if delta.num_hidden else ""
            self._line(f"[finish: {delta.finish_reason}{hidden}]")
        self.out.flush()

    def _end_reasoning(self) -> None:
        if self._in_reasoning:
            self._write("[/thinking]" + (_RESET if self.color else ""))
            self._newline()
            self._in_reasoning = False

    def _line(self, text: str) -> None:
        self._newline()
        self._write(text)
        self._newline()

    def _newline(self) -> None:
        if not self._at_line_start:
            self._write("\n")

    def _write(self, text: str) -> None:
        if text:
            self.out.write(text)
            self._at_line_start = text.endswith("\n")


def assistant_message(llm, co) -> dict[str, Any]:
    """The history entry for a reply: the recipe's parse (OpenAI message shape), or — when parsing failed — the
    text without special tokens as plain content, so no raw control spelling enters the next prompt."""
    if co.parse_error is not None:
        text = llm.tokenizer.decode(co.token_ids, skip_special_tokens=True) if llm.tokenizer is not None else ""
        return {"role": "assistant", "content": text}
    msg: dict[str, Any] = {"role": "assistant", "content": co.content or ""}
    if co.reasoning_content is not None:
        msg["reasoning_content"] = co.reasoning_content
    if co.tool_calls:
        msg["tool_calls"] = co.tool_calls
    return msg


def chat_loop(llm, ns: argparse.Namespace, *, stdin: TextIO, stdout: TextIO, interactive: bool = False) -> int:
    """Read user lines from `stdin`, stream replies to `stdout`; returns the exit status."""
    sp = sampling_params_from_cli(ns)
    color = ns.color if getattr(ns, "color", None) is not None else interactive
    base = [{"role": "system", "content": ns.system}] if ns.system else []
    history = list(base)
    while True:
        if interactive:
            try:
                line = input("user> ")
            except EOFError:
                break
        else:
            line = stdin.readline()
            if not line:
                break
            line = line.rstrip("\n")
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            history = list(base)
            continue
        if not cmd:
            continue
        history.append({"role": "user", "content": line})
        stdout.write("assistant> ")
        stdout.flush()
        printer = TurnPrinter(stdout, color=color)
        try:
            out = llm.chat(history, sp, thinking=ns.thinking, use_tqdm=False, on_delta=printer,
                           hide_special_tokens=True)[0]
        except Exception as exc:  # noqa: BLE001 - a rejected turn (recipe ConversionError, ...) must not end the chat
            history.pop()
            stdout.write(f"\n[error: {type(exc).__name__}: {exc}]\n")
            continue
        co = out.outputs[0]
        if out.error is not None:
            history.pop()
            stdout.write(f"\n[error: {out.error}]\n")
            continue
        if co.parse_error is not None:
            stdout.write(f"\n[warning: {co.parse_error}; raw output follows]\n{co.text}\n"
                         f"[finish: {co.finish_reason}]\n")
        history.append(assistant_message(llm, co))
        stdout.flush()
    return 0


def run(ns: argparse.Namespace) -> int:
    from deepinfer_engine.llm import llm_from_cli

    llm = llm_from_cli(ns)
    return chat_loop(llm, ns, stdin=sys.stdin, stdout=sys.stdout, interactive=sys.stdin.isatty())


__all__ = ["TurnPrinter", "add_arguments", "assistant_message", "chat_loop", "run"]
