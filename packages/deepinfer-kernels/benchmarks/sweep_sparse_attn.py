"""Sweep of the Triton sparse decode attention (and, with --tilelang ROWS, the TileLang kernel) at the V4.1
shapes on one GPU (CUDA only; 30-40 s on an H200 for Triton, plus about 10 s per TileLang variant to compile).

Run from the repo root:
    PYTHONPATH=packages/deepinfer-kernels/src python3 packages/deepinfer-kernels/benchmarks/sweep_sparse_attn.py \
        --output-json /tmp/sweep_sparse_attn.json [--baseline-module OLD_TRITON_PY]

Shapes: T queries (one per sequence) x 64 heads x head dim 512, 640 indices per query (128 window + 512
compressed), bf16, in the two forms the engine uses: "one" (a single pool, window rows then top-k rows) and
"two" (window pool kv [T * 128, 512] + a paged compressed store kv2 read in place through store rows), and "rec":
"two" over the deployed records of kv_cache_dtype="auto" (MXFP8 window rows of 528 bytes, NVFP4 compressed rows of
288 bytes, decoded in the kernel's gather or the TileLang producer). Each
candidate launch configuration (dot orientation, heads / rows per tile, column halves, warps, stages, split
count) is checked against the torch reference (max abs error) and timed as device time per call from CUDA-graph
replay over rotating input sets (each call reads its kv rows cold from HBM, as a decode step does). Kernels are
compiled first in parallel worker processes (they fill triton's on-disk cache), so the timed process only loads
them. `--baseline-module` times another copy of the backend file (e.g. the pre-change kernel) for before/after.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import bench_kernels  # the sibling script (this directory is on sys.path when run as a script)
import torch

H, D, WINDOW, TOPK = 64, 512, 128, 512
L2_BYTES = 60 * 2**20
POOL_ROWS = 262144  # 256 MiB of bf16 rows: random compressed rows miss L2

# (label, kwargs of triton.sparse_attn without num_splits); the kernel's own per-T choice is always timed first.
CANDIDATES: list[tuple[str, dict[str, Any]]] = [
    (
        f"o{o} h{bh} n{bn} w{w} s{s} dv{dv}",
        dict(qk_t=o, block_h=bh, block_n=bn, num_warps=w, num_stages=s, dv_split=dv),
    )
    for o, bh, bn, w, s, dv in [
        (0, 64, 64, 8, 2, 1),  # DEFAULT_CONFIG before the index prefetch (batches of more than 16 tokens)
        (0, 64, 32, 4, 3, 2),  # SMALL_BATCH_CONFIG
        (1, 64, 64, 8, 2, 1),
        (0, 64, 32, 8, 3, 1),
        (0, 64, 64, 8, 1, 1),
        (0, 32, 32, 4, 3, 2),
        (0, 16, 32, 4, 2, 1),
        (0, 64, 16, 4, 3, 2),
        (0, 32, 32, 4, 2, 1),
        (1, 64, 128, 8, 1, 1),  # S^T with M = 128 rows: no head-replicated score dot across the warpgroups
        (0, 64, 64, 8, 3, 1),  # 3 stages: the index loads become asynchronous copies 2 tiles ahead (triton 3.6)
    ]
]
# split workspace in fp32 instead of the inputs' dtype; the two sources as two loops
CANDIDATES += [
    ("o0 h64 n64 w8 s2 dv1 fp32-partials", dict(CANDIDATES[0][1], partial_dtype=torch.float32)),
    ("o0 h64 n32 w4 s3 dv2 fp32-partials", dict(CANDIDATES[1][1], partial_dtype=torch.float32)),
    ("o0 h64 n64 w8 s2 dv1 two-loop", dict(CANDIDATES[0][1], tile_src=False)),
]
# next tile's indices loaded one iteration ahead: with 32-row tiles and 3-5 stages triton 3.6 keeps 2-4 gathers in
# flight with no dependent index load before each (offline sm_90a compile: 255 registers, no spill; the default
# n64 s2 waits for all copies at the top of every iteration, so only one gather is ever in flight)
CANDIDATES += [
    (f"o0 h64 n{bn} w8 s{st} dv1 ahead{' even' if ev else ''}",
     dict(qk_t=0, block_h=64, block_n=bn, num_warps=8, num_stages=st, dv_split=1, idx_ahead=True, even_d=ev))
    for bn, st, ev in [(32, 4, False), (32, 5, False), (32, 3, False), (16, 8, False), (32, 4, True), (16, 4, True)]
]  # fmt: skip
# max |out - reference| above which a candidate is reported as a mismatch and not timed (bf16 outputs of magnitude
# <= ~2: a few ULPs; the measured configurations reach 2e-3 .. 4e-3)
MAX_ABS_ERR = 0.05


def _load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def _records(x: torch.Tensor, fmt) -> torch.Tensor:
    from deepinfer_kernels.quant.kv_formats import quantize

    codes, scales = quantize(x, fmt)
    return torch.cat([codes, scales], 1)


def _inputs(t: int, form: str, sets: int, g: torch.Generator, pool: torch.Tensor,
            pool_rec: torch.Tensor | None = None) -> list[dict[str, Any]]:  # fmt: skip
    """Index sets (and the window pools of forms "two" / "rec") for `sets` rotating calls."""
    from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3, NVFP4_E2M1

    dev = pool.device
    out = []
    for _ in range(sets):
        if form == "rec":  # the engine's two sources over records: MXFP8 window pool, NVFP4 paged store
            top = torch.randint(0, POOL_ROWS, (t, TOPK), device=dev, generator=g).sort(-1).values
            wrec = _records(torch.randn(t * WINDOW, D, device=dev, generator=g), MXFP8_E4M3)
            win = torch.arange(t * WINDOW, device=dev).view(t, WINDOW)
            out.append(dict(kv=wrec, indices=win, kv2=pool_rec, indices2=top.contiguous(), kv_format=MXFP8_E4M3,
                            kv2_format=NVFP4_E2M1))  # fmt: skip
            continue
        top = torch.randint(0, POOL_ROWS, (t, TOPK), device=dev, generator=g).sort(-1).values
        if form == "one":  # window: 128 consecutive pool rows, then 512 distinct sorted rows
            start = torch.randint(0, POOL_ROWS - WINDOW, (t, 1), device=dev, generator=g)
            win = start + torch.arange(WINDOW, device=dev)[None, :]
            out.append(dict(kv=pool, indices=torch.cat([win, top], 1).contiguous()))
        else:  # the engine's window pool: this step's rows of every sequence, then the store read in place
            wpool = torch.randn(t * WINDOW, D, device=dev, generator=g).to(torch.bfloat16)
            win = torch.arange(t * WINDOW, device=dev).view(t, WINDOW)
            out.append(dict(kv=wpool, indices=win, kv2=pool, indices2=top.contiguous()))
    return out


def _time_graph(calls, reps: int = 3, trials: int = 3) -> float:
    """Median microseconds per call from replays of one CUDA graph (bench_kernels' timer, fewer trials)."""
    return bench_kernels._time_graph(calls, reps=reps, trials=trials)


def _warm(job: tuple[str | None, dict[str, Any]]) -> str:
    """Worker: compile one configuration's specialisations (one / two sources x split / not) at T = 2."""
    path, cfg = job
    if path:
        tk = _load_module(path, "sweep_baseline_backend")
    else:
        from deepinfer_kernels.sparse_attn import triton as tk
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(2, H, D, device=dev, generator=g).to(torch.bfloat16)
    kv = torch.randn(4096, D, device=dev, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, device=dev, generator=g)
    idx = torch.randint(0, 4096, (2, WINDOW + TOPK), device=dev, generator=g)
    try:
        for ns in (1, 2):
            tk.sparse_attn(q, kv, idx, sink, D**-0.5, num_splits=ns, **cfg)
            tk.sparse_attn(q, kv, idx[:, :WINDOW], sink, D**-0.5, kv2=kv, indices2=idx[:, WINDOW:], num_splits=ns, **cfg)
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # a configuration that does not compile (shared memory, registers) is reported
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def _tiny_inputs():
    """q, kv, indices, sink of one decode token at the V4.1 head shape (a first call compiles the kernel)."""
    dev = torch.device("cuda")
    q = torch.randn(1, H, D, device=dev).to(torch.bfloat16)
    kv = torch.randn(256, D, device=dev).to(torch.bfloat16)
    return q, kv, torch.arange(128, device=dev)[None, :], torch.randn(H, device=dev)


def _warm_tilelang(job: tuple[int, bool]) -> float:
    """Worker: compile the form "rec" TileLang kernel (MXFP8 first source, NVFP4 second) at (rows per tile,
    staged) into TileLang's disk cache, which the sweep's own process then hits; returns the seconds it took."""
    rows, staged = job
    from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3, NVFP4_E2M1
    from deepinfer_kernels.sparse_attn import tilelang as tl_sa

    t0 = time.time()
    q, kv, idx, sink = _tiny_inputs()
    tl_sa.sparse_attn(q, _records(kv.float(), MXFP8_E4M3), idx, sink, D**-0.5, kv2=_records(kv.float(), NVFP4_E2M1),
                      indices2=idx, kv_format=MXFP8_E4M3, kv2_format=NVFP4_E2M1, block_rows=rows, staged=staged)  # fmt: skip
    torch.cuda.synchronize()
    return time.time() - t0


def _split_choices(t: int) -> list[int | None]:
    """None = the kernel's own choice; explicit counts where the programs alone cannot fill the GPU."""
    return {1: [None, 10], 8: [None, 4], 64: [None, 1], 256: [None]}.get(t, [None])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="64,256,1,8")
    p.add_argument("--forms", default="one,two")
    p.add_argument("--baseline-module", default=None, help="path of another sparse_attn triton.py to time as 'before'")
    p.add_argument("--only", default=None, help="comma-separated candidate labels to keep (default: all)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--budget-s", type=float, default=110.0)
    p.add_argument("--output-json", default="sweep_sparse_attn.json")
    p.add_argument("--smoke-cpu", action="store_true", help="tiny shapes in the triton interpreter (no timings)")
    p.add_argument("--tilelang", default="", help="also time the TileLang kernel at these rows per tile, e.g. 64,32")
    p.add_argument("--tilelang-staged", action="store_true",
                   help="also time the TileLang kernel's staged record producer (form rec only; 32-row tiles)")
    ns = p.parse_args()
    t_start = time.time()
    global H, D, WINDOW, TOPK, POOL_ROWS
    if ns.smoke_cpu:  # checks the script's plumbing only
        os.environ["TRITON_INTERPRET"] = "1"
        H, D, WINDOW, TOPK, POOL_ROWS = 4, 32, 16, 16, 512
        ns.batches, ns.workers = "1,3", 0
    elif not torch.cuda.is_available():
        raise SystemExit("sweep_sparse_attn: needs a CUDA device (or --smoke-cpu)")
    import triton
    from deepinfer_kernels.sparse_attn import reference
    from deepinfer_kernels.sparse_attn import triton as tk

    cands: list[tuple[str, str | None, dict[str, Any]]] = [("default (per-T config)", None, {})]
    if ns.baseline_module:
        base = _load_module(ns.baseline_module, "sweep_baseline_backend")
        cands.insert(0, ("before (baseline default)", ns.baseline_module, {}))
        if "qk_t" not in base.DEFAULT_CONFIG:
            cands.insert(1, ("before h64 n32 w8 s2", ns.baseline_module, dict(block_h=64, block_n=32, num_warps=8)))
    keep = set(ns.only.split(",")) if ns.only else None
    cands += [(lab, None, cfg) for lab, cfg in CANDIDATES if keep is None or lab in keep]
    tl_cands: list[tuple[str, str | None, dict[str, Any]]] = []
    if ns.tilelang:  # compiled in this process (tilelang's own cache), not by the triton workers
        from deepinfer_kernels.sparse_attn import tilelang as tl_sa

        tl_rows = [int(x) for x in ns.tilelang.split(",")]
        if "rec" in ns.forms.split(",") and not ns.smoke_cpu:
            # A record variant compiles in 40-100 s on the host: all of them at once, in separate processes, before
            # the timings (the first call of each below then loads it from TileLang's disk cache)
            jobs = [(rows, False) for rows in tl_rows] + ([(32, True)] if ns.tilelang_staged else [])
            t0 = time.time()
            ctx = __import__("multiprocessing").get_context("spawn")
            with ProcessPoolExecutor(max_workers=len(jobs), mp_context=ctx) as ex:
                took = list(ex.map(_warm_tilelang, jobs))
            print(f"# tilelang record variants {jobs} compiled in {time.time() - t0:.1f} s "
                  f"(each {', '.join(f'{x:.0f}' for x in took)} s)", flush=True)  # fmt: skip
        for rows in tl_rows:
            t0 = time.time()
            q1, kv1, idx1, sink1 = _tiny_inputs()
            tl_sa.sparse_attn(q1, kv1, idx1, sink1, D**-0.5, block_rows=rows)
            tl_sa.sparse_attn(q1, kv1, idx1, sink1, D**-0.5, kv2=kv1, indices2=idx1, block_rows=rows)
            print(f"# tilelang kernels (rows {rows}) compiled in {time.time() - t0:.1f} s", flush=True)
            tl_cands.append((f"tilelang ws rows {rows}", "tilelang", dict(block_rows=rows)))
        if ns.tilelang_staged:
            tl_cands.append(("tilelang staged rows 32", "tilelang", dict(block_rows=32, staged=True)))

    # compile everything in parallel first (separate processes: triton's on-disk cache is shared)
    if ns.workers > 0:
        ctx = __import__("multiprocessing").get_context("spawn")
        with ProcessPoolExecutor(max_workers=ns.workers, mp_context=ctx) as ex:
            status = list(ex.map(_warm, [(path, cfg) for _, path, cfg in cands]))
    else:
        status = ["ok"] * len(cands)
    for (lab, _, _), st in zip(cands, status):
        if st != "ok":
            print(f"# {lab}: {st}", flush=True)
    cands = [c for c, st in zip(cands, status) if st == "ok"] + tl_cands
    print(f"# compiled {len(cands)} candidates in {time.time() - t_start:.1f} s", flush=True)

    dev = torch.device("cpu" if ns.smoke_cpu else "cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    pool = torch.randn(POOL_ROWS, D, device=dev, generator=g).to(torch.bfloat16)
    pool_rec = None
    if "rec" in ns.forms.split(","):
        from deepinfer_kernels.quant.kv_formats import NVFP4_E2M1

        pool_rec = torch.cat([_records(c.float(), NVFP4_E2M1) for c in pool.split(16384)])
    sink = torch.randn(H, device=dev, generator=g)
    scale = D**-0.5
    mods = {None: tk}
    if ns.tilelang:
        mods["tilelang"] = sys.modules["deepinfer_kernels.sparse_attn.tilelang"]
    if ns.baseline_module:
        mods[ns.baseline_module] = sys.modules["sweep_baseline_backend"]
    rows: list[dict[str, Any]] = []
    print(f"{'form':<4} {'T':>4} {'candidate':<28} {'splits':>6} {'us':>9} {'max_abs_err':>11}", flush=True)
    for t in [int(x) for x in ns.batches.split(",")]:
        for form in ns.forms.split(","):
            nbytes = t * (WINDOW + TOPK) * D * 2
            sets = max(2, min(64, math.ceil(3 * L2_BYTES / nbytes)))
            q = torch.randn(t, H, D, device=dev, generator=g).to(torch.bfloat16)
            ins = _inputs(t, form, 2 if ns.smoke_cpu else sets, g, pool, pool_rec)
            i0 = ins[0]
            ref = reference.sparse_attn(q, i0["kv"], i0["indices"], sink, scale, i0.get("kv2"), i0.get("indices2"),
                                        i0.get("kv_format"), i0.get("kv2_format")).float()  # fmt: skip
            for lab, path, cfg in cands:
                if form == "rec" and path not in (None, "tilelang"):  # records: this tree's kernels only
                    continue
                if cfg.get("staged") and form != "rec":  # the staged producer reads record sources only
                    continue
                for splits in ([None] if path == "tilelang" else _split_choices(t)):
                    if time.time() - t_start > ns.budget_s:
                        break
                    kw = dict(cfg)
                    if splits is not None:
                        kw["num_splits"] = splits
                    fn = mods[path].sparse_attn
                    row: dict[str, Any] = dict(form=form, T=t, candidate=lab, splits=splits or "auto", config=kw)
                    try:
                        out = fn(q, attn_sink=sink, softmax_scale=scale, **ins[0], **kw)
                        err = float((out.float() - ref).abs().max())
                        calls = [lambda i=i, kw=kw, fn=fn, q=q: fn(q, attn_sink=sink, softmax_scale=scale, **i, **kw) for i in ins]
                        if not err <= MAX_ABS_ERR:  # checked against the reference before timing (NaN fails too)
                            row.update(us=None, max_abs_err=err, error=f"mismatch: max abs err {err:.3g}")
                        else:
                            row.update(us=None if ns.smoke_cpu else _time_graph(calls), max_abs_err=err)
                    except Exception as exc:
                        row.update(us=None, max_abs_err=None, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                    rows.append(row)
                    us = f"{row['us']:.1f}" if row["us"] is not None else ("-" if "error" not in row else "ERR")
                    e = f"{row['max_abs_err']:.2e}" if row["max_abs_err"] is not None else row.get("error", "")[:60]
                    print(f"{form:<4} {t:>4} {lab:<28} {str(row['splits']):>6} {us:>9} {e:>11}", flush=True)
    best = {}
    for r in rows:
        if r["us"] is None or r["max_abs_err"] is None or not r["max_abs_err"] <= MAX_ABS_ERR:
            continue
        key = f"{r['form']} T={r['T']}"
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    print("# best per shape:", flush=True)
    for key, r in best.items():
        print(f"#   {key}: {r['us']:.1f} us  {r['candidate']} splits={r['splits']}", flush=True)
    meta = dict(
        device="cpu (interpreter smoke)" if ns.smoke_cpu else torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        wall_s=time.time() - t_start,
    )
    with open(ns.output_json, "w") as f:
        json.dump(dict(meta=meta, rows=rows, best=best), f, indent=1, default=str)
    print(f"# {meta}", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
