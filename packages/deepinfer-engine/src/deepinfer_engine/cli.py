"""`deepinfer` command line: one subcommand per module in `deepinfer_engine.commands`."""

from __future__ import annotations

import argparse
import difflib
import importlib
import sys

# subcommand -> (module under deepinfer_engine.commands, one-line help)
_COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("generate", "generate text for prompts (args, a file, or stdin)"),
    "chat": ("chat", "interactive streaming chat"),
    "run-batch": ("run_batch", "OpenAI-batch-style JSONL in, JSONL out"),
    "serve": ("serve", "OpenAI-compatible HTTP server (completions, chat completions, streaming)"),
    "make-checkpoint": ("make_checkpoint", "write a random checkpoint in the official release format"),
    "inspect": ("inspect", "print architecture, layer plan, parameter/byte counts; check a checkpoint"),
    "bench": ("bench", "benchmarks: throughput / latency"),
    "plan": ("plan", "expert-parallel sizing: smallest prefill EP, decode layout at EP64-EP128"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="Inference for DeepSeek-V4.1-Flash.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in _COMMANDS.items():
        try:
            module = importlib.import_module(f"deepinfer_engine.commands.{module_name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"deepinfer_engine.commands.{module_name}":
                raise
            continue  # command not built yet
        # allow_abbrev=False: a misspelt or truncated option must fail, not silently match a longer one
        p = sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def _setup_logging() -> None:
    # start-up facts (cache families and their bytes per token, the cache plan) go to stderr at INFO
    import logging

    class _Stderr(logging.StreamHandler):
        """Writes to whatever sys.stderr is when a record comes (a redirect or a test harness may replace it
        after the first command of a process set the handler up)."""

        def emit(self, record: logging.LogRecord) -> None:
            self.stream = sys.stderr
            super().emit(record)

    log = logging.getLogger("deepinfer_engine")
    if not log.handlers:
        handler = _Stderr(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    _setup_logging()
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:
        sub = _subparser(parser, getattr(ns, "command", None)) or parser
        known = [o for a in sub._actions for o in a.option_strings]
        hints = []
        for arg in unknown:
            close = difflib.get_close_matches(arg.split("=")[0], known, n=3, cutoff=0.6) if arg.startswith("-") else []
            hints.append(arg + (f" (did you mean {', '.join(close)}?)" if close else ""))
        sub.error(f"unrecognized arguments: {'; '.join(hints)}")
    if not hasattr(ns, "_run"):
        parser.print_help()
        return 2
    try:
        return int(ns._run(ns) or 0)
    except Exception as exc:
        from deepinfer_engine.errors import user_error_types

        if not isinstance(exc, user_error_types()):
            raise  # a bug: the traceback is what a report needs
        # bad input or environment: the message names the file / option and the fix; a traceback would bury it
        print(f"error: {one_line(exc)}", file=sys.stderr)
        return 2


def one_line(exc: BaseException) -> str:
    """The exception's message on one line (recipe errors and OS errors carry their own wording)."""
    text = " ".join(str(exc).splitlines()).strip()
    return text or type(exc).__name__


def _subparser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and name in action.choices:
            return action.choices[name]
    return None


if __name__ == "__main__":
    sys.exit(main())
