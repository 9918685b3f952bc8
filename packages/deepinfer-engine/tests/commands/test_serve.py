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


def test_serve_answers_and_stops_on_ctrl_c(tiny_v41_dir) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "deepinfer_engine", "serve", "--port", "0", "--model",
                             str(tiny_v41_dir), "--device", "cpu", "--dtype", "float32", "--served-model-name", "t"],
                            stderr=subprocess.PIPE, text=True)
    try:
        base = None
        for line in proc.stderr:  # start-up logs, then the address line
            m = re.search(r"at (http://[\d.]+:\d+)/v1", line)
            if m:
                base = m.group(1)
                break
        assert base is not None, "the server never printed its address"
        threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep draining: a full pipe would block it
        req = urllib.request.Request(base + "/v1/completions", headers={"Content-Type": "application/json"},
                                     data=json.dumps({"model": "t", "prompt": "Hi", "max_tokens": 3}).encode())
        with urllib.request.urlopen(req, timeout=120) as r:
            body = json.loads(r.read())
        assert body["model"] == "t" and body["usage"]["completion_tokens"] == 3
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
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
