"""Greedy outputs of the engine in this process's kernel environment, and their agreement with another run's.

    python scripts/backend_agreement.py --model DIR --out A.json                       # e.g. default kernels
    DEEPINFER_KERNEL_BACKEND=triton python scripts/backend_agreement.py --model DIR --out B.json --compare A.json

Why: a new kernel backend (e.g. the TileLang sparse attention, taken by "auto" but not by
DEEPINFER_KERNEL_BACKEND=triton) must leave the engine's greedy decoding unchanged up to bf16 near-ties. The prompts
are random token ids (seeded), decoded greedily through the whole engine (CUDA graphs included). --compare prints
the fraction of requests whose tokens are identical and, for the others, the first differing position.
"""

from __future__ import annotations

import argparse
import json
import os

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--out", required=True)
    p.add_argument("--compare", help="a JSON written by an earlier run of this script")
    ns = p.parse_args()
    from deepinfer_engine import LLM, SamplingParams

    llm = LLM(ns.model, device=ns.device)
    vocab = llm.engine.core.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, min(vocab, 100000), (ns.input_len,), generator=g).tolist() for _ in range(ns.prompts)]
    outs = llm.generate(
        [{"prompt_token_ids": ids} for ids in prompts], SamplingParams(max_tokens=ns.max_tokens, temperature=0)
    )
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    env = os.environ.get("DEEPINFER_KERNEL_BACKEND", "")
    with open(ns.out, "w") as f:
        json.dump(dict(env=env, tokens=tokens), f)
    print(f"{len(tokens)} requests x {ns.max_tokens} tokens, DEEPINFER_KERNEL_BACKEND={env!r}")
    if ns.compare:
        other = json.load(open(ns.compare))["tokens"]
        same = sum(a == b for a, b in zip(tokens, other))
        first = [next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) for a, b in zip(tokens, other) if a != b]
        print(f"identical: {same}/{len(tokens)}; first differing position of the others: {sorted(first)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
