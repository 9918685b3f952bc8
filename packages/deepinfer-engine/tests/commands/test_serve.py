"""`deepinfer serve` as a process: it prints where it listens, answers, and stops cleanly on Ctrl-C; bad options
fail before the model loads."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import urllib.request

import pytest
from deepinfer_engine.cli import main
from deepinfer_engine.commands.serve import SHUTDOWN_GRACE_S


def _ignoring_sigint() -> None:  # a child started as a non-interactive shell's background job is
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize(("sig", "start"), [(signal.SIGINT, None), (signal.SIGTERM, None),
                                            (signal.SIGINT, _ignoring_sigint)], ids=["ctrl-c", "sigterm", "bg-job"])
def test_serve_answers_and_stops_on_a_signal(tiny_v41_dir, sig, start) -> None:
    """Ctrl-C and SIGTERM close the server (exit status 0), also when it was started with SIGINT ignored, as a
    background job of a script is: Python then installs no KeyboardInterrupt handler of its own."""
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer_engine", "serve", "--port", "0", "--model",
                             str(tiny_v41_dir), "--device", "cpu", "--dtype", "float32", "--served-model-name", "t"],
                            stderr=subprocess.PIPE, text=True, preexec_fn=start)
    try:
        base = None
        for line in proc.stderr:  # start-up logs, then the address line
            m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
            if m:
                base = m.group(1)
                break
        assert base is not None, "the server never printed its address"
        # keep draining (a full pipe would block the server) and keep what it says at shutdown: a hung shutdown
        # prints every thread's stack after SHUTDOWN_GRACE_S and exits with status 1
        said: list[str] = []
        reader = threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True)
        reader.start()
        req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "t", "prompt": "Hi", "max_tokens": 3}).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            body = json.loads(r.read())
        assert body["model"] == "t" and body["usage"]["completion_tokens"] == 3
        proc.send_signal(sig)
        code = proc.wait(timeout=SHUTDOWN_GRACE_S + 30)
        reader.join(timeout=10)
        assert code == 0, "".join(said[-80:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_hung_shutdown_prints_the_stacks_and_exits(tiny_v41_dir) -> None:
    """A server whose close hangs after Ctrl-C (here its engine loop's stop never returns) prints every thread's
    stack to stderr once the grace period has passed (2 s here) and exits with status 1."""
    script = "\n".join([
        "import sys, time",
        "from deepinfer_engine import server",
        "from deepinfer_engine.cli import main",
        "from deepinfer_engine.commands import serve",
        "serve.SHUTDOWN_GRACE_S = 2",
        "def stuck(self): time.sleep(600)",
        "server.ServingLoop.stop = stuck",
        f"sys.exit(main(['serve', '--port', '0', '--model', {str(tiny_v41_dir)!r}, '--device', 'cpu', '--dtype', "
        "'float32']))",
    ])
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:
            if re.search(r"at (http://[\d.]+:\d+)/v1", line):
                break
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
        said = proc.stderr.read()
        assert code == 1, said
        assert "most recent call first" in said and "in stuck" in said, said
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("args", "words"), [(["--port", "70000"], "port"),
                                             (["--default-max-tokens", "0"], "default_max_tokens")])
def test_bad_options_fail_before_the_model_loads(no_model, capsys, args, words) -> None:
    rc = main(["serve", *args, "--model", "/unused"])
    err = capsys.readouterr().err
    assert rc == 2 and words in err and "Traceback" not in err


def test_a_port_in_use_is_one_error_line(tiny_v41_dir, capsys) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc = main(["serve", "--port", str(port), "--model", str(tiny_v41_dir), "--device", "cpu", "--dtype",
                   "float32"])
    err = capsys.readouterr().err
    assert rc == 2 and f"cannot listen on 127.0.0.1:{port}" in err and "Traceback" not in err


def test_the_server_freezes_its_start_up_heap(tiny_v41_dir) -> None:
    """What start-up built is moved out of the collector's reach before the server listens, so a full collection
    while serving scans only what requests allocate. In a child process: freezing is process-wide."""
    script = "\n".join([
        "import gc, socketserver, sys",
        "from deepinfer_engine.cli import main",
        "socketserver.BaseServer.serve_forever = lambda self, *a, **k: print('frozen', gc.get_freeze_count(), "
        "file=sys.stderr)",
        f"sys.exit(main(['serve', '--port', '0', '--model', {str(tiny_v41_dir)!r}, '--device', 'cpu', '--dtype', "
        "'float32']))",
    ])
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    frozen = [int(m.group(1)) for m in re.finditer(r"^frozen (\d+)$", done.stderr, re.M)]
    # the tiny engine alone holds tens of thousands of objects (modules, tokenizer, plans); an unfrozen heap reads 0
    assert frozen and frozen[0] > 10_000, done.stderr[-4000:]
