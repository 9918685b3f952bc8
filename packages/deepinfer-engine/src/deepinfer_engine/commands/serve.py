"""`deepinfer serve`: the OpenAI-compatible HTTP server (`deepinfer_engine.server`) over one model.

Routes: POST /v1/completions, POST /v1/chat/completions (both with `"stream": true` for server-sent events),
GET /v1/models, GET /health. The model loads first; the address is printed once the server listens. Ctrl-C stops
it, and so does SIGTERM (`docker stop`, Kubernetes): requests still running get a 503.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import os
import signal
import sys

from deepinfer_engine.config import add_engine_args

# seconds a stopped server (Ctrl-C, SIGTERM) may take to close before it prints every thread's stack and exits with
# status 1
SHUTDOWN_GRACE_S = 30


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default: 8000; 0 = any free port)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id /v1/models reports (default: the checkpoint directory's name)")
    parser.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a body has none")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health (default: "
                             "$DEEPINFER_API_KEY if set, else no key)")
    add_engine_args(parser)


def run(ns: argparse.Namespace) -> int:
    from pathlib import Path

    from deepinfer_engine.errors import ConfigError
    from deepinfer_engine.llm import llm_from_cli
    from deepinfer_engine.server import make_server

    if not 0 <= ns.port <= 65535:
        raise ConfigError(f"port: found {ns.port}, expected 0..65535")
    if ns.default_max_tokens < 1:
        raise ConfigError(f"default_max_tokens: found {ns.default_max_tokens}, expected >= 1")
    api_key = ns.api_key if ns.api_key is not None else os.environ.get("DEEPINFER_API_KEY") or None
    llm = llm_from_cli(ns)
    name = ns.served_model_name or (Path(str(llm.engine.model_dir)).name if llm.engine.model_dir else "deepinfer")
    try:
        server, loop = make_server(llm, ns.host, ns.port, model_name=name, default_max_tokens=ns.default_max_tokens,
                                   api_key=api_key)
    except OSError as exc:
        llm.close()
        raise ConfigError(f"cannot listen on {ns.host}:{ns.port} ({exc.strerror or exc}); pick another --host / "
                          "--port") from None
    host, port = server.server_address[:2]
    # everything start-up built (weights' modules, tokenizer, plans, graphs) lives as long as the server: out of
    # the collector's reach, a full collection scans only what requests allocate. Unfrozen, one took about 110 ms
    # with the engine's ~241k start-up objects (docs/perf.md, "Host work of a speculative round"): a latency spike
    # in every stream of the batch. Only here, where the process owns the engine for its whole life; an `LLM`
    # built in someone else's process leaves their collector alone.
    gc.collect()
    gc.freeze()
    # SIGINT and SIGTERM stop the server through the same close. Set here, not left to Python's default: a process
    # started with SIGINT ignored (a background job of a non-interactive shell) gets no KeyboardInterrupt handler
    # from Python and would never stop on Ctrl-C, and SIGTERM's default kills without closing
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:  # from the address line on: a signal right after it closes the server as one during serving does
        print(f"deepinfer serve: model {name!r} at http://{host}:{port}/v1 (Ctrl-C stops)", file=sys.stderr,
              flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        # a shutdown that hangs must not keep the process and its port: after the grace period the stacks of all
        # threads go to stderr (what it waited on) and the process exits with status 1
        try:
            faulthandler.dump_traceback_later(SHUTDOWN_GRACE_S, exit=True)
        except (OSError, ValueError):  # stderr without a file descriptor (an embedding that captures it): no watchdog
            pass
        server.server_close()
        loop.stop()
        llm.close()
        faulthandler.cancel_dump_traceback_later()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)
