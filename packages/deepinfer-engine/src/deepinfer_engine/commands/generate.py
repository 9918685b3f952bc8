"""`deepinfer generate`: prompts from arguments, a file or stdin ('-'); with none, the built-in example
conversations go through the chat template. Prints each output and the prefill/decode tokens per second."""

from __future__ import annotations

import argparse
import json
import sys
import time

from deepinfer_engine.config import add_engine_args
from deepinfer_engine.errors import InputError
from deepinfer_engine.sampling_params import add_sampling_args, sampling_params_from_cli

EXAMPLE_CONVERSATIONS = [
    [{"role": "user", "content": "Introduce yourself in one sentence."}],
    [{"role": "user", "content": "Write a haiku about sparse attention."}],
    [{"role": "user", "content": "What is 17 * 23? Answer with the number only."}],
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="*", help="prompt texts; '-' reads one prompt per line from stdin")
    parser.add_argument("--prompt-file", help="file with one prompt per line ('-' = stdin; default: none)")
    parser.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                        help="render prompts as user turns of the chat template (default: on for the built-in "
                             "examples, off for given prompts)")
    parser.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=False,
                        help="chat in thinking mode (default: off)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per output instead of text (default: off)")
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                        help="tqdm progress bar with live prefill/decode tok/s on stderr (default: on)")
    add_sampling_args(parser, defaults={"max_tokens": 32, "temperature": 0.0})
    add_engine_args(parser)


def _read_lines(stream) -> list[str]:
    return [line.rstrip("\n") for line in stream if line.strip()]


def collect_prompts(ns: argparse.Namespace) -> list[str]:
    prompts: list[str] = []
    try:
        for p in ns.prompts:
            prompts.extend(_read_lines(sys.stdin) if p == "-" else [p])
        if ns.prompt_file:
            if ns.prompt_file == "-":
                prompts.extend(_read_lines(sys.stdin))
            else:
                with open(ns.prompt_file, encoding="utf-8") as f:
                    prompts.extend(_read_lines(f))
    except UnicodeDecodeError as exc:
        where = "stdin" if ns.prompt_file in (None, "-") else repr(ns.prompt_file)
        raise InputError(f"prompts: {where} is not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise InputError(f"prompt_file: cannot read {ns.prompt_file!r} ({exc.strerror or exc})") from None
    return prompts


def run(ns: argparse.Namespace) -> int:
    from deepinfer_engine.llm import llm_from_cli

    prompts = collect_prompts(ns)
    sp = sampling_params_from_cli(ns)
    t_load = time.perf_counter()
    llm = llm_from_cli(ns)
    t0 = time.perf_counter()
    use_chat = ns.chat if ns.chat is not None else not prompts
    if not prompts:
        convs = EXAMPLE_CONVERSATIONS
        labels = [c[-1]["content"] for c in convs]
    else:
        convs = [[{"role": "user", "content": p}] for p in prompts]
        labels = prompts
    if use_chat:
        outs = llm.chat(convs, sp, thinking=ns.thinking, use_tqdm=ns.progress)
    else:
        outs = llm.generate(prompts, sp, use_tqdm=ns.progress)
    elapsed = time.perf_counter() - t0
    failed = 0
    for i, (label, out) in enumerate(zip(labels, outs)):
        failed += out.error is not None
        if ns.json:
            print(json.dumps({
                "index": i, "prompt": label, "prompt_tokens": len(out.prompt_token_ids), "error": out.error,
                "outputs": [{"text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason,
                             "reasoning_content": o.reasoning_content, "content": o.content, "tool_calls": o.tool_calls,
                             "parse_error": o.parse_error} for o in out.outputs],
            }, ensure_ascii=False))
            continue
        print(f"--- [{i}] {label!r} ({len(out.prompt_token_ids)} prompt tokens)")
        if out.error is not None:
            print(f"    error: {out.error}")
        for o in out.outputs:
            tag = f"[{o.index}] " if len(out.outputs) > 1 else ""
            if use_chat and o.parse_error is not None:
                print(f"    {tag}warning: {o.parse_error}; raw output follows", file=sys.stderr)
                body = o.text
            else:
                body = o.content if use_chat and o.content is not None else o.text
            if use_chat and o.reasoning_content:
                print(f"    {tag}reasoning: {o.reasoning_content!r}")
            for call in (o.tool_calls or []) if use_chat else []:
                print(f"    {tag}tool call: {call['function']['name']}({call['function']['arguments']})")
            print(f"    {tag}{body!r}  ({len(o.token_ids)} tokens, finish_reason={o.finish_reason})")
    stats = llm.engine.total
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    dt = max(elapsed, 1e-9)
    print(f"{len(outs)} prompts, {n_in} prompt tokens, {n_out} output tokens in {elapsed:.2f} s "
          f"(load {t0 - t_load:.2f} s): prefill {stats.prefill_tokens / dt:.1f} tok/s, "
          f"decode {stats.decode_tokens / dt:.1f} tok/s, device {llm.engine.runner.device}", file=sys.stderr)
    return 1 if failed else 0
