"""The README usage example runs and does what it says."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import deepseek_recipe as dr

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_example_tokenizes_and_parses():
    text = README.read_text(encoding="utf-8")
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block is not None, "README has no python example"
    code = block.group(1)
    statements = [n for n in ast.parse(code).body if not isinstance(n, ast.Import | ast.ImportFrom)]
    assert len(statements) == 5
    ns: dict = {}
    exec(compile(code, str(README), "exec"), ns)
    ids, chunks, tok = ns["ids"], ns["chunks"], ns["tok"]
    # The prompt starts with BOS and ends with <｜Assistant｜><think> (thinking on by default).
    assert ids[0] == 0 and ids[-2:] == [128804, 128821]
    response = dr.ChatCompletionResponse("resp-1", "DeepSeek-V4-Pro", 0, 0, 0)
    for c in chunks:
        response.accumulate(c)
    message = json.loads(response.to_json())["choices"][0]
    assert message["message"]["reasoning_content"] == "Let me think."
    assert message["message"]["content"] == "Hello!"
    assert message["finish_reason"] == "stop"
    assert tok.decode(ids).endswith("<｜User｜>Hi<｜Assistant｜><think>")
