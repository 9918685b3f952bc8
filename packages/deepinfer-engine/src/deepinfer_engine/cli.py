"""`deepinfer` command line: one subcommand per module in `deepinfer_engine.commands`."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module under deepinfer_engine.commands, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate", "generate text for prompts (args, a file, or stdin)"),
    "chat": ("chat", "interactive streaming chat"),
    "run-batch": ("run_batch", "OpenAI-batch-style JSONL in, JSONL out"),
    "make-checkpoint": ("make_checkpoint", "write a random checkpoint in the official release format"),
    "inspect": ("inspect", "print architecture, layer plan, parameter/byte counts; check a checkpoint"),
    "bench": ("bench", "benchmarks: throughput / latency"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="Offline inference for DeepSeek-V4.1-Flash.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in _COMMANDS.items():
        try:
            module = importlib.import_module(f"deepinfer_engine.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"deepinfer_engine.commands.{module_name}":
                raise
            continue  # command not built yet
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not hasattr(ns, "_run"):
        parser.print_help()
        return 2
    return int(ns._run(ns) or 0)


if __name__ == "__main__":
    sys.exit(main())
