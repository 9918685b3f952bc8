"""The OpenAI-compatible server on the tiny V4.1 checkpoint (CPU, float32): whole and streamed completions and
chat completions give what the offline API gives, concurrent requests share the batch, and bad requests -- not
JSON, invalid values, refused at admission, unknown routes -- fail alone with a clear error while the server keeps
serving; a streaming client that leaves has its request aborted."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from deepinfer_engine.llm import LLM
from deepinfer_engine.sampling_params import SamplingParams
from deepinfer_engine.server import serve_in_thread
from engine_testing import plain_ids, script_replies


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    model = LLM(str(tiny_ckpt("v41")), device="cpu", dtype="float32")
    yield model
    model.close()


@pytest.fixture(scope="module")
def ref(tiny_ckpt):
    """A second engine for the offline results: the served one belongs to the server's engine thread."""
    model = LLM(str(tiny_ckpt("v41")), device="cpu", dtype="float32")
    yield model
    model.close()


@pytest.fixture(scope="module")
def url(llm):
    base, stop = serve_in_thread(llm, model_name="tiny", default_max_tokens=4)
    yield base
    stop()


def _post(url: str, path: str, body: object, *, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _stream(url: str, path: str, body: dict) -> list[dict | str]:
    req = urllib.request.Request(url + path, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200 and r.headers["Content-Type"] == "text/event-stream"
        events = [line[6:] for line in r.read().decode().splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_health_and_models(url) -> None:
    with urllib.request.urlopen(url + "/health", timeout=30) as r:
        assert json.loads(r.read())["status"] == "ok"
    with urllib.request.urlopen(url + "/v1/models", timeout=30) as r:
        assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny"]


def test_completion_equals_the_offline_api_whole_and_streamed(url, ref) -> None:
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 6, "temperature": 0}
    want = ref.generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0]
    status, r = _post(url, "/v1/completions", body)
    assert status == 200 and r["object"] == "text_completion"
    assert r["choices"][0]["text"] == want.outputs[0].text
    assert r["usage"] == {"prompt_tokens": len(want.prompt_token_ids), "completion_tokens": 6,
                          "total_tokens": len(want.prompt_token_ids) + 6}
    events = _stream(url, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == want.outputs[0].text
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 1
    assert events[-2]["usage"]["completion_tokens"] == 6


def test_chat_equals_the_offline_api_whole_and_streamed(url, ref) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    want = ref.chat(messages, SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0].outputs[0]
    body = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0,
            "thinking": {"type": "disabled"}}  # LLM.chat's default; the recipe's own default for a body is to think
    status, r = _post(url, "/v1/chat/completions", body)
    assert status == 200 and r["object"] == "chat.completion"
    msg = r["choices"][0]["message"]
    assert msg["role"] == "assistant" and msg["content"] == want.content
    assert r["choices"][0]["finish_reason"] == want.finish_reason


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_streamed_chat_deltas_add_up_to_the_whole_response(url, thinking) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8,
            "temperature": 0, "thinking": {"type": thinking}}
    status, whole = _post(url, "/v1/chat/completions", body)
    assert status == 200
    msg = whole["choices"][0]["message"]
    events = _stream(url, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    deltas = [e["choices"][0] for e in events[:-1]]
    assert deltas[0]["delta"]["role"] == "assistant"
    assert "".join(d["delta"].get("content") or "" for d in deltas) == (msg["content"] or "")
    assert "".join(d["delta"].get("reasoning_content") or "" for d in deltas) == (msg.get("reasoning_content") or "")
    assert deltas[-1]["finish_reason"] == whole["choices"][0]["finish_reason"] and deltas[-1]["delta"] == {}


def test_concurrent_requests_all_complete(url) -> None:
    results: list[tuple[int, dict]] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        res = _post(url, "/v1/completions", {"prompt": f"request {i}", "max_tokens": 5, "temperature": 0})
        with lock:
            results.append(res)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 6 and all(s == 200 and r["usage"]["completion_tokens"] == 5 for s, r in results)


def test_a_prompt_that_can_never_fit_is_a_400_streamed_or_not(tiny_ckpt) -> None:
    model = LLM(str(tiny_ckpt("v41")), device="cpu", dtype="float32", max_model_len=16)
    base, stop = serve_in_thread(model)
    try:
        for stream in (False, True):
            status, r = _post(base, "/v1/completions", {"prompt": list(range(100, 120)), "stream": stream})
            assert status == 400 and "max_model_len" in r["error"]["message"], (stream, r)
    finally:
        stop()
        model.close()


@pytest.mark.parametrize(("path", "body", "raw", "status", "words"), [
    ("/v1/completions", None, b"{not json", 400, "not UTF-8 JSON"),
    ("/v1/completions", None, b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, None, 400, "temperature"),
    ("/v1/completions", {"prompt": 5}, None, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, None, 400, "token id"),  # refused at admission, in the engine thread
    ("/v1/chat/completions", {"messages": "hi"}, None, 400, "messages"),
    ("/v1/embeddings", {"input": "x"}, None, 404, "/v1/completions"),
    ("/v1/completions", {"prompt": "x", "echo": True}, None, 400, "echo"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, None, 400, "best_of"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 10}}, None, 400,
     "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_object"}}, None, 400, "response_format"),
])  # fmt: skip
def test_bad_requests_fail_alone_and_the_server_keeps_serving(url, path, body, raw, status, words) -> None:
    got, r = _post(url, path, body, raw=raw)
    assert got == status, r
    assert words.lower() in r["error"]["message"].lower(), r
    ok, r = _post(url, "/v1/completions", {"prompt": "still there?", "max_tokens": 2})
    assert ok == 200 and r["usage"]["completion_tokens"] == 2


def _wait_idle(url: str, llm) -> None:
    deadline = time.time() + 60
    while time.time() < deadline:  # the loop notices, aborts the request, the batch empties
        with urllib.request.urlopen(url + "/health", timeout=30) as r:
            if json.loads(r.read())["active_requests"] == 0:
                break
        time.sleep(0.2)
    assert not llm.engine.has_unfinished_requests()


def test_a_waiting_client_that_leaves_has_its_request_aborted(url, llm) -> None:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "a long one", "max_tokens": 10_000, "ignore_eos": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    deadline = time.time() + 60
    while llm.engine.has_unfinished_requests() is False and time.time() < deadline:
        time.sleep(0.05)  # admitted and running
    sock.close()
    _wait_idle(url, llm)


def test_a_streaming_client_that_leaves_has_its_request_aborted(url, llm) -> None:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "a long one", "max_tokens": 10_000, "ignore_eos": True, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    head = b""
    while b"data: " not in head:  # the headers and the first event: generation has started
        head += sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 200")
    sock.close()  # leave mid-stream
    _wait_idle(url, llm)


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line and not line.startswith("#")}


def test_metrics_count_requests_by_outcome_and_tokens(url) -> None:
    before = _metrics(url)
    assert _post(url, "/v1/completions", {"prompt": "count me", "max_tokens": 3})[0] == 200
    assert _post(url, "/v1/completions", {"prompt": [10**9]})[0] == 400  # refused at admission
    assert _post(url, "/v1/completions", {"prompt": 5})[0] == 400  # refused before the engine: not counted there
    after = _metrics(url)
    assert after['deepinfer_requests_ended_total{outcome="ok"}'] == before['deepinfer_requests_ended_total{outcome="ok"}'] + 1
    assert (after['deepinfer_requests_ended_total{outcome="refused"}']
            == before['deepinfer_requests_ended_total{outcome="refused"}'] + 1)
    assert after["deepinfer_decode_tokens_total"] >= before["deepinfer_decode_tokens_total"] + 2
    assert after["deepinfer_prefill_tokens_total"] > before["deepinfer_prefill_tokens_total"]
    assert after["deepinfer_requests_running"] == 0


def test_streamed_chat_reports_a_tool_call_then_its_finish_reason(tiny_ckpt, monkeypatch) -> None:
    """A scripted reply (content, then the DSML tool-call markup, then EOS) on a server of its own: the stream
    carries the content, one tool call with its JSON arguments, and finish_reason "tool_calls"; the whole response
    carries the same."""
    model = LLM(str(tiny_ckpt("v41")), device="cpu", dtype="float32")
    markup = ('Checking.\n\n<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n'
              '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n</｜DSML｜ invoke>\n'
              '</｜DSML｜ calls>')
    reply = plain_ids(model, markup) + [model.engine.eos_token_ids[0]]
    script_replies(model, monkeypatch, [reply, reply])
    base, stop = serve_in_thread(model)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}}]
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools, "max_tokens": 200,
            "thinking": {"type": "disabled"}}
    try:
        events = _stream(base, "/v1/chat/completions", body)
        status, whole = _post(base, "/v1/chat/completions", body)
    finally:
        stop()
        model.close()
    deltas = [e["choices"][0] for e in events[:-1]]
    assert "".join(d["delta"].get("content") or "" for d in deltas).strip() == "Checking."
    calls = [c for d in deltas for c in d["delta"].get("tool_calls") or ()]
    assert len(calls) == 1 and calls[0]["function"]["name"] == "get_weather" and calls[0]["index"] == 0
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert deltas[-1]["finish_reason"] == "tool_calls"
    assert status == 200 and whole["choices"][0]["finish_reason"] == "tool_calls"
    assert whole["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_several_samples_per_request_whole_and_streamed(url) -> None:
    body = {"prompt": "two ways", "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 7}
    status, whole = _post(url, "/v1/completions", body)
    assert status == 200 and [c["index"] for c in whole["choices"]] == [0, 1]
    assert whole["usage"]["completion_tokens"] == 8
    events = _stream(url, "/v1/completions", body)
    texts = {0: "", 1: ""}
    finishes = {0: [], 1: []}
    for e in events[:-1]:
        c = e["choices"][0]
        texts[c["index"]] += c["text"]
        if c["finish_reason"] is not None:
            finishes[c["index"]].append(c["finish_reason"])
    assert texts == {c["index"]: c["text"] for c in whole["choices"]}  # same seed: the same samples
    assert finishes == {0: ["length"], 1: ["length"]}  # one finish chunk per sample


@pytest.mark.parametrize("discard_fails", [False, True], ids=["step", "step-and-cleanup"])
def test_an_engine_step_that_raises_fails_its_requests_and_the_server_goes_on(url, llm, monkeypatch,
                                                                              discard_fails) -> None:
    real, real_discard = llm.engine.step_outputs, llm.engine.discard
    calls = {"n": 0}

    def flaky():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected step failure")
        return real()

    def discard(ids):
        real_discard(ids)
        if discard_fails:  # the cleanup raising too must not kill the engine thread
            raise RuntimeError("injected cleanup failure")

    monkeypatch.setattr(llm.engine, "step_outputs", flaky)
    monkeypatch.setattr(llm.engine, "discard", discard)
    status, r = _post(url, "/v1/completions", {"prompt": "unlucky", "max_tokens": 3})
    assert status == 500 and "injected step failure" in r["error"]["message"]
    status, r = _post(url, "/v1/completions", {"prompt": "lucky", "max_tokens": 3})
    assert status == 200 and r["usage"]["completion_tokens"] == 3
    assert not llm.engine.has_unfinished_requests()


def test_an_api_key_guards_every_route_but_health(ref) -> None:
    base, stop = serve_in_thread(ref, api_key="s3cret")  # an engine no other loop drives

    def get(path: str, key: str | None) -> int:
        req = urllib.request.Request(base + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    try:
        assert get("/health", None) == 200
        assert get("/v1/models", None) == 401 and get("/v1/models", "wrong") == 401
        assert get("/v1/models", "s3cret") == 200
        status, r = _post(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 401 and "Authorization: Bearer" in r["error"]["message"]
    finally:
        stop()
