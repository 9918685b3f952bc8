"""The HTTP server on CUDA (gpu marker): the engine thread runs the CUDA graphs, and concurrent greedy requests get
what the offline API gives on the same device, in fp32."""

from __future__ import annotations

import json
import threading
import urllib.request

import pytest
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.server import serve_in_thread
from engine_testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu

OPTIONS = {"device": "cuda", "dtype": "float32", "page_size": 8, "num_kv_pages": 256, "max_num_seqs": 8,
           "max_model_len": 128}


def test_concurrent_requests_on_cuda_equal_the_offline_api(tmp_path) -> None:
    ckpt = make_tiny_checkpoint(tmp_path / "ckpt", arch="v41")
    prompts = [[0, 11, 12, 13], [0, *range(100, 119)], [0, 7], [0, 40, 41, 42, 43]]
    ref = LLM(str(ckpt), **OPTIONS)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                                                 ignore_eos=True), use_tqdm=False)]
    llm = LLM(str(ckpt), **OPTIONS)
    base, stop = serve_in_thread(llm)
    got: dict[int, list[int]] = {}

    def one(i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            content = json.loads(r.read())["choices"][0]["logprobs"]["content"]
        got[i] = [t["token_id"] for t in content]

    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
    finally:
        stop()
    assert [got.get(i) for i in range(len(prompts))] == [list(w) for w in want]
