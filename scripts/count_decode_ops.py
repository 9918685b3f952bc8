"""CPU proxy of the GPU kernel launches of one decode step: the aten ops (and Triton launches) per module.

    TRITON_INTERPRET=1 DEEPINFER_KERNEL_BACKEND=triton python scripts/count_decode_ops.py [--batch 1,8]
        [--steps 3] [--dtype bf16] [--json OUT] [--ops]

Builds a tiny V4.1 checkpoint shaped like the `layers-4` slice (SWA, SWA+Engram, ratio-2 Full, ratio-2 Reuse;
o_groups 8 with o_lora_rank a multiple of the FP8 block, so the grouped output projection takes the per-group
FP8 path of the real width), loads it quantized (FP8 Linears, FP4 experts) and runs the fixed-shape decode step
(`StaticDecodeStep`, what the CUDA graph captures) followed by the greedy sampler. Every aten op that would launch
a device kernel is counted (views, metadata and allocation ops are not: see `_launches`); a Triton kernel launch
counts as one, and the torch ops the interpreter runs inside it are not counted. Each op is attributed to the
innermost frame of the Python stack that matches a rule of `_RULES` (attention / compressor / indexer / mhc /
engram / moe routing / moe experts / moe combine / norms / linear / embed+head / sampler / step plan).

With TRITON_INTERPRET=1 and DEEPINFER_KERNEL_BACKEND=triton the ops that have a Triton kernel run it (as
kernel_backend "auto" does on CUDA); without them every op runs its torch reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

# (path fragment, function name or None = any, category), matched innermost frame first
_RULES: list[tuple[str, str | None, str]] = [
    ("deepinfer_engine/worker/sampler.py", None, "sampler"),
    ("deepinfer_kernels/sampling/", None, "sampler"),
    ("deepinfer_kernels/linear/", None, "linear"),
    ("deepinfer_engine/model/linear.py", None, "linear"),
    ("deepinfer_kernels/norm_rope/", "rms_norm", "norms"),
    ("deepinfer_engine/model/attention.py", "RMSNorm.forward", "norms"),
    ("deepinfer_kernels/hyper_conn/", None, "mhc"),
    ("deepinfer_engine/model/mhc.py", None, "mhc"),
    ("deepinfer_engine/model/engram", None, "engram"),
    ("deepinfer_engine/model/token_ring.py", None, "engram"),
    ("deepinfer_engine/model/model.py", "Transformer._engram_rows", "engram"),
    ("deepinfer_engine/model/moe.py", "Gate.forward", "moe routing"),
    ("deepinfer_kernels/routing/", None, "moe routing"),
    ("deepinfer_kernels/moe/", None, "moe experts"),
    ("deepinfer_parallel/", None, "moe experts"),
    ("deepinfer_engine/model/moe.py", "Expert.forward", "moe shared"),
    ("deepinfer_engine/model/moe.py", None, "moe combine"),
    ("deepinfer_engine/model/csa2.py", "csa2_update_source", "compressor"),
    ("deepinfer_engine/model/csa2.py", "Csa2Compressor", "compressor"),
    ("deepinfer_engine/model/csa2.py", "csa2_select", "indexer"),
    ("deepinfer_engine/model/csa2.py", "Csa2Indexer", "indexer"),
    ("deepinfer_engine/model/csa2.py", "padded_scores", "indexer"),
    ("deepinfer_engine/model/attention.py", "Compressor", "compressor"),
    ("deepinfer_engine/model/attention.py", "Indexer", "indexer"),
    ("deepinfer_engine/model/attention.py", None, "attention"),
    ("deepinfer_kernels/sparse_attn/", None, "attention"),
    ("deepinfer_engine/model/block.py", None, "mhc"),
    ("deepinfer_engine/model/static_step.py", None, "step plan"),
    ("deepinfer_engine/model/forward_batch.py", None, "step plan"),
    ("deepinfer_engine/model/model.py", None, "embed+head"),
]
CATEGORIES = ("attention", "compressor", "indexer", "mhc", "engram", "moe routing", "moe experts", "moe shared",
              "moe combine", "norms", "linear", "embed+head", "sampler", "step plan", "other")
# allocations and metadata: no kernel on the device (zeros / full / copies are counted: they fill memory)
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "lift_fresh",
              "detach", "set_", "resize_", "record_stream", "is_pinned", "_pin_memory", "clone_"}


def _category(frame: object) -> str:
    f = frame
    while f is not None:
        path = f.f_code.co_filename.replace(os.sep, "/")
        qual = getattr(f.f_code, "co_qualname", f.f_code.co_name)
        for frag, fn, cat in _RULES:
            if frag in path and (fn is None or qual == fn or qual.startswith(fn + ".")):
                return cat
        f = f.f_back
    return "other"


class _Counter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.ops: dict[str, Counter[str]] = defaultdict(Counter)
        self.syncs = 0
        self.inside_triton = 0

    def record(self, name: str) -> None:
        cat = _category(sys._getframe(2))
        self.counts[cat] += 1
        self.ops[cat][name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if self.inside_triton:
            return out
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.syncs += 1
        elif not (func.is_view or name in _NO_KERNEL):  # `x.to(x.dtype)` never reaches here: a _to_copy copies
            self.record(name)
        return out


def _patch_triton(counter_ref: list[_Counter | None]) -> None:
    """Count each interpreted Triton launch once, and none of the torch ops the interpreter runs inside it."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted_run(self, *args, **kwargs):  # noqa: ANN001
        c = counter_ref[0]
        if c is None:
            return run(self, *args, **kwargs)
        if not c.inside_triton:
            cat = _category(sys._getframe(1))
            c.counts[cat] += 1
            c.ops[cat]["triton:" + self.fn.__name__] += 1
        c.inside_triton += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            c.inside_triton -= 1

    InterpretedFunction.run = counted_run


def layers4_like_config() -> dict:
    """Tiny V4.1 with the layer kinds of `layers-4` (SWA, SWA+Engram, ratio-2 Full, ratio-2 Reuse)."""
    from deepinfer_engine.model.presets import tiny_v41_config

    cfg = tiny_v41_config()
    tc = cfg["text_config"]
    drafts = tc["compress_ratios"][tc["num_hidden_layers"]:]
    tc.update(num_hidden_layers=4, compress_ratios=[0, 0, 2, 2] + drafts, kv_source_layer_ids=[2],
              index_source_layer_ids=[2], engram_layer_ids=[1], engram_num_embeddings=[462],
              num_attention_heads=8, o_groups=8, o_lora_rank=32,
              index_head_dim=32)  # a multiple of the 32-channel MXFP4 block: the records of kv_cache_dtype="auto"
    for k in ("candidate_source_layer_id", "candidate_topk_blocks", "candidate_block_size"):
        tc.pop(k)
    tc["dspark_target_layer_ids"] = [1, 2, 3]
    return cfg


def run(batch_sizes: list[int], steps: int, dtype: torch.dtype, kv_cache_dtype: str = "bfloat16") -> dict:
    from deepinfer_engine.model.cache import ModelCache
    from deepinfer_engine.model.forward_batch import ForwardBatch, StepHost
    from deepinfer_engine.model.loader import load_model
    from deepinfer_engine.model.static_step import DecodeFacts, StaticDecodeStep
    from deepinfer_engine.model.writer import write_checkpoint
    from deepinfer_engine.sampling_params import SamplingParams
    from deepinfer_engine.worker.sampler import Sampler, build_sampling_batch

    ref: list[_Counter | None] = [None]
    if os.environ.get("TRITON_INTERPRET"):
        _patch_triton(ref)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_checkpoint(Path(tmp) / "ck", layers4_like_config(), seed=0)
        model = load_model(ckpt, dtype=dtype, with_draft=False).eval()
    a = model.args
    counted_backend = model.kernel_backend
    page, max_len = 16, 64
    results = {}
    for B in batch_sizes:
        cache = ModelCache.allocate(a, num_slots=B, num_pages=B * (max_len // page), page_size=page, dtype=dtype,
                                    kv_cache_dtype=kv_cache_dtype)
        tables = np.arange(B * (max_len // page), dtype=np.int32).reshape(B, -1)
        gen = torch.Generator().manual_seed(1)
        lens = [11 + 3 * i for i in range(B)]
        model.set_kernel_backend("torch")  # the prefill is not counted: the references are faster on CPU
        for s, n in enumerate(lens):  # prefill each sequence eagerly
            ids = torch.randint(0, a.vocab_size, (n,), generator=gen)
            bt = tables[[s]]
            model(ForwardBatch(input_ids=ids, positions=torch.arange(n), query_lens=(n,), slots=(s,),
                               block_tables=torch.from_numpy(bt), logits_indices=torch.tensor([n - 1]),
                               host=StepHost(ctx_lens=(0,), input_ids=ids.numpy(), block_tables=bt)), cache)
        model.set_kernel_backend(counted_backend)
        step = StaticDecodeStep(cache, B, max_len, "cpu")
        sampler = Sampler()
        params = [SamplingParams(temperature=0.0, max_tokens=8)] * B
        nxt = torch.randint(0, a.vocab_size, (B,), generator=gen).tolist()
        per_step = []
        for k in range(steps + 1):  # step 0 registers the static plans (warm-up, as before a capture)
            bt = tables[list(range(B))]
            batch = ForwardBatch(
                input_ids=torch.tensor(nxt), positions=torch.tensor(lens), query_lens=(1,) * B,
                slots=tuple(range(B)), block_tables=torch.from_numpy(bt), logits_indices=torch.arange(B),
                host=StepHost(ctx_lens=tuple(lens), input_ids=np.asarray(nxt, np.int64), block_tables=bt))
            model.host_step(batch, cache)
            step.fill(DecodeFacts.of(batch))
            sb = build_sampling_batch(params, [0] * B, [0] * B, [[]] * B, [[]] * B, [()] * B, torch.device("cpu"))
            c = _Counter()
            ref[0] = c
            with c:
                logits = model.forward_features(None, cache, static=step).logits
                out = sampler(logits, sb)
            ref[0] = None
            if k:
                per_step.append(c)
            print(f"B={B} step {k}: {sum(c.counts.values())} launches", file=sys.stderr, flush=True)
            nxt = out.token_ids.tolist()
            lens = [n + 1 for n in lens]
        counts = {cat: sum(c.counts[cat] for c in per_step) / len(per_step) for cat in CATEGORIES}
        ops = {cat: {op: n / len(per_step) for op, n in
                     sum((c.ops[cat] for c in per_step), Counter()).most_common()} for cat in CATEGORIES}
        results[B] = {"counts": counts, "total": sum(counts.values()), "ops": ops,
                      "syncs": sum(c.syncs for c in per_step) / len(per_step)}
    return results


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,8")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--json")
    p.add_argument("--ops", action="store_true", help="also list the ops of each category")
    p.add_argument("--kv-cache-dtype", default="bfloat16", choices=("bfloat16", "auto"),
                   help="the cache's storage: plain, or V4.1's deployed records (read in place by the attention)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    bs = [int(b) for b in args.batch.split(",")]
    res = run(bs, args.steps, torch.bfloat16 if args.dtype == "bf16" else torch.float32, args.kv_cache_dtype)
    backend = os.environ.get("DEEPINFER_KERNEL_BACKEND", "auto")
    print(f"kernel launches per decode step (CPU proxy; backend={backend}, "
          f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')}, dtype={args.dtype}, kv_cache_dtype={args.kv_cache_dtype})")
    print(f"{'module':<14}" + "".join(f"{'B=' + str(b):>8}" for b in bs))
    for cat in CATEGORIES:
        print(f"{cat:<14}" + "".join(f"{res[b]['counts'][cat]:>8.0f}" for b in bs))
    print(f"{'total':<14}" + "".join(f"{res[b]['total']:>8.0f}" for b in bs))
    print(f"{'host syncs':<14}" + "".join(f"{res[b]['syncs']:>8.0f}" for b in bs))
    if args.ops:
        for cat in CATEGORIES:
            ops = res[bs[0]]["ops"][cat]
            if ops:
                print(f"\n[{cat}] B={bs[0]}: " + ", ".join(f"{op} x{n:g}" for op, n in ops.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
