"""An OpenAI-compatible HTTP server over one `LLM`: `/v1/completions` and `/v1/chat/completions` (whole
responses or server-sent-event streams), `/v1/models`, `/health`, `/metrics` (Prometheus text). Standard library
only.

Threads: the HTTP server gives each connection a thread (`ThreadingHTTPServer`); one engine thread (`ServingLoop`)
owns the engine. A handler checks and translates its body (`openai_api.prepare`), hands it to the loop and reads
the request's events from its own queue; the loop admits new requests between steps, steps while any request is
unfinished and routes each step's outputs to their queues, so concurrent requests share the continuous batch.

A bad request fails alone: an invalid body is a 400 before it reaches the engine, a request the engine refuses at
admission (prompt too long, ids outside the vocabulary, ...) is a 400 for that request only, and a step that fails
finishes only the requests it computed (their error is a 500, the engine goes on serving). A streaming client that
disconnects has its request aborted, so its sequence leaves the batch.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import queue
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from deepinfer_engine.openai_api import (
    CHAT_URL,
    COMPLETIONS_URL,
    Prepared,
    chat_chunk,
    completion_chunk,
    output_failure,
    prepare,
    response_body,
    usage,
)

__all__ = ["ServingLoop", "make_server", "metrics_text", "serve_in_thread"]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a request body larger than this is refused (413) before it is read


@dataclass
class _Event:
    """What the loop tells a handler: "text" (completions: new text of a sample), "delta" (chat: a ChatDelta of
    a sample), "done" (the finished RequestOutput) or "error" (`status`, `message`)."""

    kind: str
    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    delta: Any = None
    output: Any = None
    status: int = 200
    message: str = ""


@dataclass
class _Pending:
    request_id: str
    prepared: Prepared
    stream: bool = False  # the handler streams: text events per step (else only the finished output matters)
    events: queue.Queue = field(default_factory=queue.Queue)
    sent: dict[int, int] = field(default_factory=dict)  # completions: characters of each sample already sent
    ended: set[int] = field(default_factory=set)  # completions: samples whose finish reason was sent


class ServingLoop:
    """Owns the engine on one thread: `submit` a prepared request and read its events, `abort` it, `stop` the
    loop. Outputs are snapshotted on the loop thread (a RequestOutput is updated in place until it finishes)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self._inbox: queue.Queue = queue.Queue()
        self._active: dict[str, _Pending] = {}
        self._counter = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deepinfer-engine", daemon=True)
        # requests that ended, by outcome (written by the engine thread only; /metrics reads them)
        self.ended = {"ok": 0, "error": 0, "aborted": 0, "refused": 0}

    def start(self) -> ServingLoop:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join()

    def submit(self, prepared: Prepared, *, stream: bool = False) -> _Pending:
        with self._lock:
            self._counter += 1
            rid = f"srv-{self._counter}"
        pending = _Pending(rid, prepared, stream)
        self._inbox.put(("add", pending))
        return pending

    def abort(self, pending: _Pending) -> None:
        self._inbox.put(("abort", pending))

    def num_active(self) -> int:
        return len(self._active)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        eng = self.llm.engine
        runner = eng.runner  # None for a data-parallel engine: its models live in the rank processes
        device = runner.device if runner is not None else None
        if device is not None and device.type == "cuda":
            import torch

            torch.cuda.set_device(device)  # a new thread's current device is cuda:0; kernels launch on the current one
        while True:
            # idle: sleep until something arrives; busy: take what is there, then step
            items = [] if eng.has_unfinished_requests() else [self._inbox.get()]
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            try:
                for item in items:
                    if item is not None:
                        self._handle(item)
                if self._stop.is_set():
                    break
                if eng.has_unfinished_requests():
                    self._step()
            except Exception as exc:  # noqa: BLE001 -- the thread must outlive any failure, or every request hangs
                log.exception("serving loop")
                self._fail_all(f"{type(exc).__name__}: {exc}")
        if self._active:  # shutting down: nobody waits forever
            eng.discard(list(self._active))
        for p in self._active.values():
            p.events.put(_Event("error", status=503, message="the server is shutting down"))
        self._active.clear()

    def _handle(self, item: tuple[str, _Pending]) -> None:
        what, p = item
        if what == "abort":
            if p.request_id in self._active:
                self.llm.engine.abort_request(p.request_id)
            return
        self._admit(p)

    def _admit(self, p: _Pending) -> None:
        from deepinfer_engine.errors import InputError

        eng, prep = self.llm.engine, p.prepared
        params = prep.render.sampling(prep.params) if prep.render is not None else prep.params
        try:
            req = eng.process_input(prep.prompt, params)
            chat = None if prep.render is None else self.llm.chat_spec(prep.render)
            eng.add_processed(p.request_id, req, chat=chat)
        except InputError as exc:  # refused at admission: this request's 400, the batch goes on
            self.ended["refused"] += 1
            p.events.put(_Event("error", status=400, message=str(exc)))
            return
        except Exception as exc:  # noqa: BLE001 -- one request's failure must not stop the loop
            log.exception("admission of %s failed", p.request_id)
            self.ended["error"] += 1
            p.events.put(_Event("error", status=500, message=f"{type(exc).__name__}: {exc}"))
            return
        self._active[p.request_id] = p

    def _fail_all(self, message: str) -> None:
        """Every request in flight ends with a 500 and leaves the engine, so the next requests start clean."""
        ids = list(self._active)
        try:
            self.llm.engine.discard(ids)
        except Exception:  # noqa: BLE001 -- the requests are failed either way; the log keeps the cause
            log.exception("discarding the failed requests")
        self.ended["error"] += len(ids)
        for rid in ids:
            self._active.pop(rid).events.put(_Event("error", status=500, message=message))

    def _step(self) -> None:
        eng = self.llm.engine
        try:
            step = eng.step_outputs()
        except Exception as exc:  # noqa: BLE001 -- the engine failed outside any one request: fail the batch
            log.exception("engine step failed")
            self._fail_all(f"engine step failed: {exc}")
            return
        for rid, index, delta in step.chat_deltas:
            p = self._active.get(rid)
            if p is not None and p.stream:
                p.events.put(_Event("delta", index=index, delta=delta))
        for out in step.request_outputs:
            p = self._active.get(out.request_id)
            if p is None:
                continue
            # streamed completions: the text each sample gained (an output with an error is reported by "done")
            if p.stream and p.prepared.render is None and out.error is None:
                for co in out.outputs:
                    n = p.sent.get(co.index, 0)
                    if co.index in p.ended or (len(co.text) == n and co.finish_reason is None):
                        continue
                    p.sent[co.index] = len(co.text)
                    if co.finish_reason is not None:
                        p.ended.add(co.index)
                    p.events.put(_Event("text", index=co.index, text=co.text[n:], finish_reason=co.finish_reason))
            if out.finished:
                del self._active[out.request_id]
                reasons = {co.finish_reason for co in out.outputs}
                self.ended["error" if out.error is not None or "error" in reasons
                           else "aborted" if "abort" in reasons else "ok"] += 1
                p.events.put(_Event("done", output=out))


def metrics_text(loop: ServingLoop) -> str:
    """The Prometheus text exposition of the server's counters: requests running and ended (by outcome), the
    engine's prefill / decode tokens and, with speculation, the draft, verified and accepted tokens."""
    eng = loop.llm.engine
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP deepinfer_{name} {help_text}", f"# TYPE deepinfer_{name} {kind}"])
        lines.extend(f"deepinfer_{name}{labels} {value:g}" for labels, value in samples)

    metric("requests_running", "gauge", "Requests admitted and not finished.", [("", loop.num_active())])
    metric("requests_ended_total", "counter", "Requests that ended, by outcome.",
           [(f'{{outcome="{k}"}}', v) for k, v in loop.ended.items()])
    metric("prefill_tokens_total", "counter", "Prompt tokens computed (prefix-cache hits excluded).",
           [("", eng.total.prefill_tokens)])
    metric("decode_tokens_total", "counter", "Tokens generated by decode steps.", [("", eng.total.decode_tokens)])
    spec = eng.spec_stats()
    if spec is not None:
        metric("spec_draft_tokens_total", "counter", "Draft tokens proposed.", [("", spec.num_draft_tokens)])
        metric("spec_verified_tokens_total", "counter", "Draft tokens verified.", [("", sum(spec.verified))])
        metric("spec_accepted_tokens_total", "counter", "Draft tokens accepted.", [("", sum(spec.accepted))])
    return "\n".join(lines) + "\n"


def _error_json(status: int, message: str) -> dict[str, Any]:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "code": status}}


def _final_error(out: Any) -> tuple[int, str] | None:
    """(status, message) when a finished output is not a result (`openai_api.output_failure`): the client's to fix
    (400) when the engine says the request cannot fit (its capacity refusals start "prompt " or "sequence
    reached ": `max_model_len`, the whole cache, the token budget, an empty prompt), else the server's (500: a
    failed step, non-finite logits, a chat sample the recipe could not parse)."""
    failure = output_failure(out)
    if failure is None:
        return None
    code, message = failure
    client = code == "request_failed" and message.startswith(("prompt ", "sequence reached "))
    return (400 if client else 500), message


class _Handler(BaseHTTPRequestHandler):
    server_version = "deepinfer"
    protocol_version = "HTTP/1.1"
    loop: ServingLoop  # set on the subclass by make_server
    model_name: str
    default_max_tokens: int
    api_key: str | None = None

    def _authorized(self) -> bool:
        """With an API key, every route but /health needs `Authorization: Bearer <key>` (else a 401 is sent)."""
        if self.api_key is None or self.path == "/health":
            return True
        if hmac.compare_digest(self.headers.get("Authorization", ""), f"Bearer {self.api_key}"):
            return True
        self.close_connection = True  # a POST body is not read
        self._send_error(401, "missing or wrong API key; send the header 'Authorization: Bearer <key>'")
        return False

    def log_message(self, fmt: str, *args: Any) -> None:  # the access log goes to the package logger
        log.debug("%s %s", self.address_string(), fmt % args)

    # ------------------------------------------------------------------ plumbing
    def _send_json(self, status: int, obj: dict[str, Any]) -> None:
        data = json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _send_error(self, status: int, message: str) -> None:
        self._send_json(status, _error_json(status, message))

    def _read_body(self) -> dict[str, Any] | None:
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self.close_connection = True  # the body (if any) was not read: the connection cannot be reused
            self._send_error(411, "a request body with a Content-Length header is required")
            return None
        if length < 0 or length > MAX_BODY_BYTES:
            self.close_connection = True  # the body is not read
            self._send_error(413 if length > 0 else 400,
                             f"Content-Length {length}; expected 0..{MAX_BODY_BYTES} bytes")
            return None
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            self._send_error(400, f"the request body is not UTF-8 JSON: {exc}")
            return None
        if not isinstance(body, dict):
            self._send_error(400, "the request body must be a JSON object")
            return None
        return body

    # ------------------------------------------------------------------ routes
    def do_GET(self) -> None:
        if not self._authorized():
            return
        if self.path == "/health":
            self._send_json(200, {"status": "ok", "active_requests": self.loop.num_active()})
        elif self.path == "/metrics":
            data = metrics_text(self.loop).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        elif self.path == "/v1/models":
            self._send_json(200, {"object": "list", "data": [
                {"id": self.model_name, "object": "model", "created": 0, "owned_by": "deepinfer"}]})
        else:
            self._send_error(404, f"no route GET {self.path}; expected /health, /metrics or /v1/models")

    def do_POST(self) -> None:
        if not self._authorized():
            return
        if self.path not in (CHAT_URL, COMPLETIONS_URL):
            self.close_connection = True  # its body is not read: the connection cannot carry another request
            self._send_error(404, f"no route POST {self.path}; expected {COMPLETIONS_URL} or {CHAT_URL}")
            return
        body = self._read_body()
        if body is None:
            return
        try:
            prepared = prepare(self.loop.llm, self.path, body, self.default_max_tokens)
            stream = bool(body.get("stream", False))
            include_usage = bool((body.get("stream_options") or {}).get("include_usage", False))
        except Exception as exc:  # noqa: BLE001 -- recipe ConversionError, SamplingParamsError, ...: a 400
            self._send_error(400, f"{type(exc).__name__}: {exc}")
            return
        pending = self.loop.submit(prepared, stream=stream)
        if stream:
            self._stream(pending, include_usage)
        else:
            self._whole(pending)

    def _events(self, pending: _Pending, *, watch_client: bool = False) -> Iterator[_Event]:
        """The request's events up to its last. watch_client: while none arrives, check every half second that
        the client is still connected; if it left, abort the request (and stop)."""
        while True:
            try:
                ev = pending.events.get(timeout=0.5 if watch_client else None)
            except queue.Empty:
                if self._client_gone():
                    self.loop.abort(pending)
                    return
                continue
            yield ev
            if ev.kind in ("done", "error"):
                return

    def _client_gone(self) -> bool:
        """The peer closed its side: the socket reads as ready with nothing to read (a pipelined next request
        would be data, not EOF)."""
        try:
            ready, _, _ = select.select([self.connection], [], [], 0)
            return bool(ready) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _whole(self, pending: _Pending) -> None:
        try:
            for ev in self._events(pending, watch_client=True):
                if ev.kind == "error":
                    self._send_error(ev.status, ev.message)
                elif ev.kind == "done":
                    bad = _final_error(ev.output)
                    if bad is not None:
                        self._send_error(*bad)
                        return
                    prefix = "chatcmpl" if pending.prepared.render is not None else "cmpl"
                    self._send_json(200, response_body(pending.prepared.url, pending.prepared.body, ev.output,
                                                       f"{prefix}-{pending.request_id}", int(time.time())))
        except (BrokenPipeError, ConnectionResetError):  # the client left as the answer was written
            self.close_connection = True

    def _stream(self, pending: _Pending, include_usage: bool) -> None:
        """Server-sent events: the first event decides the status (an admission error is still a JSON 400); then
        one chunk per text / delta event, the finish reasons, optionally the usage, and `data: [DONE]`."""
        events = self._events(pending)
        first = next(events)
        if first.kind == "error":
            self._send_error(first.status, first.message)
            return
        bad = _final_error(first.output) if first.kind == "done" else None
        if bad is not None:  # finished before any text (e.g. the prompt can never fit): still a plain error
            self._send_error(*bad)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        prep, created = pending.prepared, int(time.time())
        chat = prep.render is not None
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{pending.request_id}"
        started: set[int] = set()

        def chunks(ev: _Event) -> list[dict[str, Any]]:
            if ev.kind == "text":
                return [completion_chunk(prep.body, rid, created, ev.index, ev.text, ev.finish_reason)]
            if ev.kind != "delta":
                return []
            out = []
            if ev.index not in started:
                started.add(ev.index)
                out.append(chat_chunk(prep.body, rid, created, ev.index, {"role": "assistant", "content": ""}))
            d = ev.delta
            if d.kind == "content":
                out.append(chat_chunk(prep.body, rid, created, ev.index, {"content": d.text}))
            elif d.kind == "reasoning":
                out.append(chat_chunk(prep.body, rid, created, ev.index, {"reasoning_content": d.text}))
            elif d.kind == "tool_call":
                call = {"index": 0, **d.tool_call}
                out.append(chat_chunk(prep.body, rid, created, ev.index, {"tool_calls": [call]}))
            elif d.kind == "finish":
                out.append(chat_chunk(prep.body, rid, created, ev.index, {}, d.finish_reason))
            return out

        try:
            for ev in itertools.chain([first], events):
                if ev.kind == "error":  # after the headers: the error travels as an event
                    self._sse(_error_json(ev.status, ev.message))
                    break
                for c in chunks(ev):
                    self._sse(c)
                if ev.kind == "done":
                    bad = _final_error(ev.output)
                    if bad is not None:
                        self._sse(_error_json(*bad))
                    elif include_usage:
                        self._sse({"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                                   "created": created, "model": prep.body.get("model"), "choices": [],
                                   "usage": usage(ev.output)})
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client left: its sequence leaves the batch
            self.loop.abort(pending)

    def _sse(self, obj: dict[str, Any]) -> None:
        self.wfile.write(b"data: " + json.dumps(obj, ensure_ascii=False).encode("utf-8", "backslashreplace")
                         + b"\n\n")
        self.wfile.flush()


def make_server(llm: Any, host: str = "127.0.0.1", port: int = 8000, *, model_name: str = "deepinfer",
                default_max_tokens: int = 256, api_key: str | None = None) -> tuple[ThreadingHTTPServer, ServingLoop]:
    """The HTTP server (not yet serving: call `serve_forever`) and its started engine loop. Port 0 picks a free
    port (`server.server_address`). api_key: required as a bearer token on every route but /health. Shut down
    with `server.shutdown()` then `loop.stop()`."""
    loop = ServingLoop(llm)
    handler = type("DeepInferHandler", (_Handler,), {"loop": loop, "model_name": model_name,
                                                      "default_max_tokens": default_max_tokens, "api_key": api_key})
    server = ThreadingHTTPServer((host, port), handler)  # may raise (address in use): no thread is started yet
    server.daemon_threads = True
    return server, loop.start()


def serve_in_thread(llm: Any, **options: Any) -> tuple[str, Callable[[], None]]:
    """`make_server(llm, "127.0.0.1", 0, **options)` serving on a daemon thread: (its base URL, a function that
    stops it). For benchmarks and tests in the same process."""
    server, loop = make_server(llm, "127.0.0.1", 0, **options)
    threading.Thread(target=server.serve_forever, name="deepinfer-http", daemon=True).start()

    def stop() -> None:
        server.shutdown()
        server.server_close()
        loop.stop()

    return "http://{}:{}".format(*server.server_address[:2]), stop
