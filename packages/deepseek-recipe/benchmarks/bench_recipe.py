"""Benchmark (not a test): render+encode throughput for long conversations and stream-parse throughput.

Prints a fixed-width table and optionally writes the rows as JSON (--output-json PATH).
The parse path must sustain well over 10k tok/s so it is never the bottleneck of a 10k tok/s engine.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import deepseek_recipe as dr

_WORDS = (
    "the model reads a long request about kernels caches tensors and schedulers then answers with code "
    'und erklärt es auf Deutsch 并且用中文解释 😀 while quoting {"json": [1, 2, 3]} and <tags> literally'
).split()


def _sentence(i: int, n: int) -> str:
    return " ".join(_WORDS[(i * 7 + k) % len(_WORDS)] for k in range(n))


def _conversation(turns: int, thinking: bool, system: bool) -> dr.Conversation:
    # [I] V4.1 prompts with a system part need `<｜System｜>`, absent from the public V4 tokenizer: no system there.
    msgs: list[dr.Message] = (
        [dr.SystemMessage("You are a careful assistant. " + _sentence(0, 40))] if system else []
    )
    for t in range(turns):
        msgs.append(dr.UserMessage(_sentence(t, 80)))
        if t % 4 == 3:
            call = dr.ToolCall(f"call_{t}", "lookup", json.dumps({"query": _sentence(t, 8), "limit": 5}))
            msgs.append(dr.AssistantMessage("", _sentence(t + 1, 30), [call]))
            msgs.append(dr.ToolMessage(_sentence(t + 2, 60), f"call_{t}"))
        msgs.append(dr.AssistantMessage(_sentence(t + 3, 120), _sentence(t + 4, 40)))
    msgs.append(dr.UserMessage("Summarize."))
    tools = [
        dr.ToolDefinition(
            "lookup",
            "Look something up.",
            {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}}},
        )
    ]
    return dr.Conversation(msgs, thinking_mode=thinking, tools=tools if system else [])


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def bench_render_encode(tok: dr.Tokenizer, repeat: int) -> list[dict]:
    rows = []
    for version, enc, thinking in (
        ("v4", dr.DeepseekV4Encoding(), True),
        ("v4.1", dr.DeepseekV41Encoding(), False),
    ):
        encoder = enc.with_tokenizer(tok)
        system = version == "v4"
        for turns in (8, 64, 256):
            conv = _conversation(turns, thinking, system)
            n = len(encoder.encode(conv))
            t_render = _best(lambda conv=conv, enc=enc: enc.render_conversation(conv), repeat)
            t_total = _best(lambda conv=conv, encoder=encoder: encoder.encode(conv), repeat)
            rows.append(
                {
                    "bench": "render+encode",
                    "case": f"{version} {turns} turns",
                    "tokens": n,
                    "render_ms": round(t_render * 1e3, 3),
                    "total_ms": round(t_total * 1e3, 3),
                    "tok_per_s": round(n / t_total),
                }
            )
    return rows


def _model_output(n_tokens_target: int) -> str:
    parts = []
    reasoning = " ".join(_sentence(i, 50) for i in range(max(1, n_tokens_target // 160)))
    parts.append(reasoning + "\n</think>\n\n")
    parts.append(" ".join(_sentence(i + 3, 50) for i in range(max(1, n_tokens_target // 160))))
    parts.append(
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="lookup">\n'
        '<｜DSML｜parameter name="query" string="true">' + _sentence(5, 40) + "</｜DSML｜parameter>\n"
        '<｜DSML｜parameter name="limit" string="false">5</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    )
    return "".join(parts)


def bench_parse(tok: dr.Tokenizer, repeat: int, n_tokens: int) -> list[dict]:
    rows = []
    output = _model_output(n_tokens)
    ids = tok.encode(output)
    body = {
        "model": "DeepSeek-V4-Pro",
        "messages": [{"role": "user", "content": "q"}],
        "tools": [{"type": "function", "function": {"name": "lookup"}}],
        "stop": ["<<STOP>>"],
    }
    apis = {
        "chat_completions": dr.ChatCompletionRequest,
        "messages": dr.MessagesRequest,
        "responses": dr.ResponsesRequest,
    }
    bodies = {
        "chat_completions": body,
        "messages": {
            **{k: v for k, v in body.items() if k not in ("tools", "stop")},
            "max_tokens": 100000,
            "tools": [{"name": "lookup", "input_schema": {"type": "object"}}],
            "stop_sequences": ["<<STOP>>"],
        },
        "responses": {
            "model": "DeepSeek-V4-Pro",
            "input": "q",
            "tools": [{"type": "function", "name": "lookup"}],
        },
    }
    for api, cls in apis.items():
        req = cls(bodies[api]).convert()
        for mode, step in (("tokens x1", 1), ("tokens x16", 16), ("text x1", 0)):
            if mode.startswith("text"):
                pieces = [tok.decode([i]) for i in ids]
                chunks = [dr.InferenceChunk.text(p, 1) for p in pieces]
            else:
                chunks = [dr.InferenceChunk.tokens(ids[i : i + step]) for i in range(0, len(ids), step)]

            def run(req=req, chunks=chunks, cls=cls):
                gen = cls.chunk_generator(req, "r", "m")
                proc = dr.StreamProcessor(gen, req.parsing_options, tok)
                n_out = 0
                for c in chunks:
                    n_out += len(proc.push(c))
                n_out += len(proc.finish())
                return n_out

            t = _best(run, repeat)
            rows.append(
                {
                    "bench": "stream-parse",
                    "case": f"{api} {mode}",
                    "tokens": len(ids),
                    "total_ms": round(t * 1e3, 3),
                    "tok_per_s": round(len(ids) / t),
                }
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--parse-tokens", type=int, default=20000, help="approximate generated-output length")
    ap.add_argument("--output-json", default=None)
    args = ap.parse_args(argv)
    tok = dr.Tokenizer.deepseek_v4()
    rows = bench_render_encode(tok, args.repeat) + bench_parse(tok, args.repeat, args.parse_tokens)
    header = f"{'bench':<14} {'case':<32} {'tokens':>8} {'total ms':>10} {'tok/s':>12}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['bench']:<14} {r['case']:<32} {r['tokens']:>8} {r['total_ms']:>10.1f} {r['tok_per_s']:>12,}"
        )
    if args.output_json:
        meta = {
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "deepseek_recipe": dr.__version__,
        }
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
