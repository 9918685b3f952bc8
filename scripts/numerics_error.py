"""Logit error of the deployed numerics (`kv_cache_dtype="auto"`) against full-precision KV, on one checkpoint.

    python scripts/numerics_error.py --model DIR [--device cuda] [--tokens 512] [--output-json F]

Both runs load the same weights (kept in their checkpoint formats) and prefill the same random prompt: "bfloat16"
= full-precision KV and bf16 activations into the FP8 GEMMs; "auto" = FP8 activation quantization before every FP8
GEMM and the KV record formats (stored as compact records where the cache can, rounded by the model otherwise).
Prints the per-position relative L2 error of the logits (median, 90th percentile, max) and the top-1 agreement.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--output-json")
    ns = p.parse_args()
    from deepinfer_engine.model.cache import ModelCache, stores_records
    from deepinfer_engine.model.forward_batch import ForwardBatch
    from deepinfer_engine.model.loader import load_model

    dtype = torch.bfloat16 if ns.device.startswith("cuda") else torch.float32
    g = torch.Generator().manual_seed(0)
    logits = {}
    for mode in ("bfloat16", "auto"):
        deployed = mode == "auto"
        model = load_model(ns.model, dtype=dtype, device=ns.device, quantize_activations=deployed)
        records = deployed and stores_records(model.args)
        model.set_deployed_numerics(deployed, cache_records=records)
        ids = torch.randint(3, min(model.args.vocab_size, 128000), (ns.tokens,), generator=g.manual_seed(0))
        cache, bt = ModelCache.allocate_dense(model.args, [ns.tokens], dtype=dtype, device=ns.device,
                                              kv_cache_dtype="auto" if records else "bfloat16")
        with torch.inference_mode():
            logits[mode] = model(ForwardBatch.single(ids.to(ns.device), block_table=bt), cache).float().cpu()
        del model, cache
        if ns.device.startswith("cuda"):
            torch.cuda.empty_cache()
    ref, dep = logits["bfloat16"], logits["auto"]
    rel = ((dep - ref).norm(dim=-1) / ref.norm(dim=-1)).sort().values
    res = {"model": ns.model, "device": ns.device, "tokens": ns.tokens, "dtype": str(dtype),
           "rel_l2_median": rel[len(rel) // 2].item(), "rel_l2_p90": rel[int(0.9 * (len(rel) - 1))].item(),
           "rel_l2_max": rel[-1].item(), "top1_agreement": (dep.argmax(-1) == ref.argmax(-1)).float().mean().item()}
    print(json.dumps(res, indent=1))
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
