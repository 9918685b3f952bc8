"""deepseek_recipe works without torch or any other workspace member."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    for name in ("torch", "deepinfer_kernels", "deepinfer_parallel", "deepinfer_dspark", "deepinfer_engine"):
        sys.modules[name] = None  # any import of these now raises ImportError
    import deepseek_recipe as dr
    tok = dr.Tokenizer.deepseek_v4()
    req = dr.ChatCompletionRequest(
        {"model": "DeepSeek-V4-Pro", "messages": [{"role": "user", "content": "Hi"}], "thinking": {"type": "disabled"}}
    ).convert()
    ids = req.encoding().with_tokenizer(tok).encode(req.conversation)
    gen = dr.ChatCompletionRequest.chunk_generator(req, "r", "DeepSeek-V4-Pro")
    proc = dr.StreamProcessor(gen, req.parsing_options, tok)
    out = proc.push(dr.InferenceChunk.tokens(tok.encode("Hello"))) + proc.finish()
    loaded = [m for m in ("torch", "numpy", "deepinfer_engine") if sys.modules.get(m) is not None]
    print(len(ids), len(out), loaded)
    """
)


def test_recipe_imports_and_runs_without_torch():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    n_ids, n_chunks, loaded = proc.stdout.strip().split(" ", 2)
    assert int(n_ids) > 3 and int(n_chunks) == 3
    assert loaded == "[]"
