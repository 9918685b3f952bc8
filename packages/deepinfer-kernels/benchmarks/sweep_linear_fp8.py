"""Launch-config sweep of the FP8 block-scaled linear (`fp8_linear`, Triton) at decode sizes, V4.1-Flash shapes.

The shapes are the FP8 Linears one decode step of the V4.1 `layers-4` slice (hidden 5120, 32 x 32 UE8M0 blocks)
runs, with their calls per step: per layer wq_a, wq_b, wkv, wo_a (8 groups, one call each: `Linear.grouped`),
wo_b, the shared expert's w1 / w3 / w2; once per step the CSA2 indexer's wq_b and the Engram wkv (both computed
in fp32 by the model; timed here with bf16 activations, plus one fp32 row at the default config).

Per shape and M (tokens) every candidate config is first checked against the torch reference (max |Δ| / max |ref|
<= 1e-2, bf16 output), then timed from replays of one CUDA graph over several weight copies (so a pass moves >= 3x
the 60 MB L2: cold weights, as in a decode step; launch gaps inside the graph included, as in the engine's graphed
step). Phase A: tile configs with the default split policy ("group" / "weight" MMA tiles, CUDA-core "fma", at
M <= 16 "gemv" with register prefetch 0 / 1 / 2, and from M = 8 "frag", the codes decoded into the wgmma operand); phase B: the best tile, and the best "gemv" tile when another mode
won, with explicit split counts 1..64 and `LinearConfig.programs` targets. Each case prints the best config and
the default config as `LinearConfig(...)`; `--modes` restricts the candidates (compile time).
Printed beside the bytes bound (weight + scale + x + y bytes / device copy bandwidth measured in the same run).
`--baseline-module PATH` also times another `linear/triton.py` (e.g. main's) at its own defaults as "before".
Configs are compiled first in parallel worker processes (Triton's on-disk cache is shared).

    PYTHONPATH=packages/deepinfer-kernels/src python packages/deepinfer-kernels/benchmarks/sweep_linear_fp8.py \
        [--tokens 1,8,64,256] [--modes group,weight,fma,gemv,frag] [--baseline-module OLD/triton.py] [--defaults-only] \
        [--budget-s 180] [--workers 12] [--output-json out.json]

Decode sizes in about four minutes on one H200 (16 CPU cores for the compile workers):

    PYTHONPATH=packages/deepinfer-kernels/src python packages/deepinfer-kernels/benchmarks/sweep_linear_fp8.py \
        --tokens 1,8,64 --modes weight,fma,gemv --budget-s 170 --workers 15 --output-json sweep_linear_fp8.json
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import torch
from deepinfer_kernels._launch import next_pow2
from deepinfer_kernels.device_rates import measure_copy_bandwidth

L2_BYTES = 60 * 2**20
BLOCK = (32, 32)
# (name, N, K, calls per decode step of V4.1 layers-4, model compute dtype)
SHAPES = [
    ("attn.wq_a", 1280, 5120, 4, "bf16"),
    ("attn.wq_b", 32768, 1280, 4, "bf16"),
    ("attn.wkv", 512, 5120, 4, "bf16"),
    ("attn.wo_a (per group)", 1024, 4096, 32, "bf16"),
    ("attn.wo_b", 5120, 8192, 4, "bf16"),
    ("shared_experts.w1/w3", 2304, 5120, 8, "bf16"),
    ("shared_experts.w2", 5120, 2304, 4, "bf16"),
    ("indexer.wq_b", 4096, 1280, 1, "fp32"),
    ("engram.wkv", 25600, 6144, 1, "fp32"),
]
SPLITS = (1, 2, 4, 8, 16, 32, 64)
PROGRAMS = (132, 264, 528)  # `LinearConfig.programs` targets (split 0), one, two, four H200s' worth of SMs


def gemv_candidates(m: int) -> list[tuple[int, int, int, int, int, bool, str, int]]:
    """"gemv" tiles (CUDA-core FMAs on weights decoded in registers) at M = m <= 16: (..., prefetch). The register
    prefetch of activations (2) costs registers per row: at M = 8 the larger tiles spill with it (offline sm_90a
    compile), so there they prefetch the weights only (1) or nothing (0)."""
    bm = next_pow2(m)
    if bm < 4:
        return [
            (bm, 16, 512, 4, 1, False, "gemv", 2),
            (bm, 32, 256, 4, 1, False, "gemv", 2),
            (bm, 16, 256, 4, 1, False, "gemv", 2),
            (bm, 64, 256, 8, 1, False, "gemv", 2),
            (bm, 16, 1024, 8, 1, False, "gemv", 2),
            (bm, 16, 512, 4, 1, False, "gemv", 1),
            (bm, 16, 512, 4, 3, False, "gemv", 0),  # no manual prefetch, Triton's pipeliner instead
        ]
    return [
        (bm, 16, 512, 4, 1, False, "gemv", 1),
        (bm, 16, 256, 4, 1, False, "gemv", 2),
        (bm, 16, 256, 4, 1, False, "gemv", 1),
        (bm, 32, 256, 8, 1, False, "gemv", 1),
        (bm, 16, 128, 4, 1, False, "gemv", 2),
        (bm, 32, 128, 4, 1, False, "gemv", 0),
        (bm, 16, 512, 4, 3, False, "gemv", 0),
    ]


def tile_candidates(m: int) -> list[tuple[int, int, int, int, int, bool, str, int]]:
    """(block_m, block_n, block_k, num_warps, num_stages, swap_ab, mode, prefetch) tried at M = m (a first run over
    many "group" tiles, docs/perf.md, narrowed the MMA tiles to these; prefetch only matters to "gemv")."""
    return ([t if len(t) == 8 else (*t, 2) for t in _mma_fma_candidates(m)] + (gemv_candidates(m) if m <= 16 else [])
            + frag_candidates(m))


def frag_candidates(m: int) -> list[tuple[int, int, int, int, int, bool, str, int]]:
    """"frag" tiles (codes decoded into the wgmma register operand, linear.fp8_frag.triton) at M = m >= 8: 64 or 128
    weight rows, up to 64 (128 at M >= 128) tokens, one or two 128-column chunks per K step."""
    if m < 8:
        return []
    bm = min(64, max(16, next_pow2(m)))
    tiles = [(bm, 64, 128, 4, 3), (bm, 64, 128, 4, 4), (bm, 64, 256, 4, 3), (bm, 128, 128, 8, 3),
             (bm, 128, 128, 4, 3)]
    if m >= 128:
        tiles += [(128, 64, 128, 4, 3), (128, 128, 128, 8, 3)]
    return [(*t, False, "frag", 2) for t in tiles]


def _mma_fma_candidates(m: int) -> list[tuple]:
    if m <= 16:
        bm = next_pow2(m)
        return [
            (16, 64, 128, 4, 4, False, "group"),
            (16, 32, 256, 4, 4, False, "group"),
            (16, 64, 128, 4, 4, False, "weight"),
            (16, 32, 128, 4, 4, False, "weight"),
            (16, 128, 128, 8, 4, False, "weight"),
            (16, 64, 256, 4, 3, False, "weight"),
            (16, 64, 128, 4, 4, True, "weight"),
            (bm, 32, 128, 4, 3, False, "fma"),
            (bm, 16, 128, 4, 3, False, "fma"),
            (bm, 32, 64, 4, 3, False, "fma"),
            (bm, 64, 64, 4, 3, False, "fma"),
            (bm, 16, 256, 4, 3, False, "fma"),
        ]
    if m <= 64:
        return [
            (32, 64, 128, 4, 3, True, "group"),
            (64, 128, 128, 4, 3, False, "group"),
            (32, 64, 128, 4, 3, True, "weight"),
            (64, 64, 128, 4, 3, True, "weight"),
            (64, 128, 128, 4, 3, True, "weight"),
            (64, 128, 128, 4, 3, False, "weight"),
            (32, 64, 128, 4, 3, False, "weight"),
        ]
    return [
        (128, 128, 128, 8, 3, True, "group"),
        (64, 128, 128, 4, 3, False, "group"),
        (128, 128, 128, 8, 3, True, "weight"),
        (64, 128, 128, 4, 3, True, "weight"),
        (64, 128, 128, 4, 3, False, "weight"),
        (128, 128, 128, 8, 3, False, "weight"),
        (128, 64, 128, 4, 3, True, "weight"),
    ]


def load_module(path: str, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def random_fp8(n: int, k: int, g: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(-126, 127, (n, k), generator=g, dtype=torch.int8, device=dev)
    w = torch.where((w & 0x7F) == 0x7F, torch.zeros_like(w), w)  # no NaN codes
    sb = torch.randint(
        118, 124, (-(-n // BLOCK[0]), -(-k // BLOCK[1])), generator=g, dtype=torch.uint8, device=dev
    )
    return w.view(torch.float8_e4m3fn), sb.view(torch.float8_e8m0fnu)


def _warm(job: tuple[str, Any]) -> str:
    """Worker: compile one tile config, or the default configs of ours / the baseline module at one M, at every
    specialisation the sweep hits."""
    kind, arg = job
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    q, s = random_fp8(2304, 5120, g, dev)
    try:
        if kind == "tile":
            from deepinfer_kernels.linear import triton as lt

            *tile, ms = arg
            bm, bn, bk, w, st, swap, mode, pf = tile
            for m, split, aq in itertools.product(ms, (1, 4), (False, True)):
                x = torch.randn(m, 5120, device=dev, generator=g)
                cfg = lt.LinearConfig(bm, bn, bk, w, st, split, swap, mode, prefetch=pf)
                lt.fp8_linear(x.bfloat16(), q, s, BLOCK, act_quant=aq, config=cfg)
                if mode in ("fma", "gemv") and not aq:
                    lt.fp8_linear(x, q, s, BLOCK, act_quant=False, config=cfg)
        else:  # "defaults": (baseline module path or None = ours, M): every shape, act_quant, fp32 rows
            path, m = arg
            mod = load_module(path, "sweep_baseline_linear") if path else None
            if mod is None:
                from deepinfer_kernels.linear import triton as mod
            for _, n, k, _, dt in SHAPES:
                qq, ss = random_fp8(n, k, g, dev)
                x = torch.randn(m, k, device=dev, generator=g)
                for xx, aq in ((x.bfloat16(), False), (x.bfloat16(), True)) + (
                    ((x, False),) if dt == "fp32" else ()
                ):
                    mod.fp8_linear(xx, qq, ss, BLOCK, act_quant=aq)
        torch.cuda.synchronize()
        return "ok"
    except Exception as exc:  # a config that does not compile / fit is a sweep result
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


class Case:
    """One (shape, M): weight copies to rotate, activations, the reference output, the bytes bound."""

    def __init__(
        self, shape: tuple, m: int, bw: float, g: torch.Generator, dev: torch.device, smoke: bool
    ) -> None:
        from deepinfer_kernels.linear import reference

        self.name, self.n, self.k, self.calls, self.dtype = shape
        self.m = m
        wbytes = self.n * self.k + (self.n // BLOCK[0]) * (self.k // BLOCK[1])
        self.nbytes = wbytes + m * self.k * 2 + m * self.n * 2
        self.bound_us = self.nbytes / bw * 1e6 if bw else None
        sets = 2 if smoke else max(2, min(72, math.ceil(3 * L2_BYTES / wbytes)))
        self.weights = [random_fp8(self.n, self.k, g, dev) for _ in range(sets)]
        xf = torch.randn(m, 8 * self.k if "wo_a" in self.name else self.k, device=dev, generator=g)
        self.x32 = xf[
            :, : self.k
        ]  # wo_a: a strided [T, in/G] view of [T, G, in/G], as `Linear.grouped` passes
        self.x = xf.bfloat16()[:, : self.k]
        q, s = self.weights[0]
        self.want = reference.fp8_linear(self.x.float(), q, s, BLOCK)
        self.want_aq = reference.fp8_linear(self.x.float(), q, s, BLOCK, act_quant=True)
        self.want32 = reference.fp8_linear(self.x32, q, s, BLOCK)

    def measure(self, fn, x, want, smoke: bool) -> dict[str, Any]:
        import bench_kernels  # the sibling script (this directory is on sys.path when run as a script)

        row: dict[str, Any] = {}
        try:
            q, s = self.weights[0]
            row["rel_err"] = rel(fn(x, q, s), want)
            tol = 1e-5 if x.dtype == torch.float32 else 1e-2
            if row["rel_err"] > tol:
                row["error"] = f"rel_err {row['rel_err']:.2e} over tolerance"
            elif not smoke:
                calls = [lambda q=q, s=s: fn(x, q, s) for q, s in self.weights]
                row["us"] = bench_kernels._time_graph(calls, reps=3, trials=3)
                row["of_bound"] = self.bound_us / row["us"]
        except Exception as exc:  # noqa: BLE001 - a config that fails is a sweep result
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", default="1,8,64,256")
    ap.add_argument("--shapes", default=None, help="comma-separated shape names to keep (default: all)")
    ap.add_argument(
        "--baseline-module", default=None, help="path of another linear/triton.py timed as 'before'"
    )
    ap.add_argument(
        "--defaults-only", action="store_true", help="time only the default configs (and baseline)"
    )
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--modes", default="group,weight,fma,gemv,frag", help="decode modes of the candidates to sweep")
    ap.add_argument("--budget-s", type=float, default=180.0)
    ap.add_argument("--output-json", default="sweep_linear_fp8.json")
    ap.add_argument(
        "--smoke-cpu", action="store_true", help="tiny shapes in the triton interpreter (no timings)"
    )
    ns = ap.parse_args()
    t_start = time.time()
    global SHAPES
    if ns.smoke_cpu:  # checks the script's plumbing only
        os.environ["TRITON_INTERPRET"] = "1"
        SHAPES = [("tiny", 64, 256, 2, "bf16"), ("tiny fp32", 32, 128, 1, "fp32")]
        ns.tokens, ns.workers = "1,3", 0
    elif not torch.cuda.is_available():
        raise SystemExit("sweep_linear_fp8: needs a CUDA device (or --smoke-cpu)")
    if ns.shapes:
        keep = set(ns.shapes.split(","))
        SHAPES = [s for s in SHAPES if s[0] in keep]
    import triton
    from deepinfer_kernels.linear import triton as lt

    tokens = [int(v) for v in ns.tokens.split(",")]
    modes = set(ns.modes.split(","))

    def candidates(m: int) -> list[tuple]:
        return [t for t in tile_candidates(m) if t[6] in modes]

    jobs: list[tuple[str, Any]] = [("defaults", (None, m)) for m in tokens]
    if ns.baseline_module:
        jobs += [("defaults", (ns.baseline_module, m)) for m in tokens]
    if not ns.defaults_only:
        groups: dict[tuple, list[int]] = {}
        for m in tokens:
            for c in candidates(m):
                groups.setdefault(c, []).append(m)
        jobs += [("tile", (*c, ms)) for c, ms in groups.items()]
    if ns.workers > 0:
        ctx = __import__("multiprocessing").get_context("spawn")
        with ProcessPoolExecutor(max_workers=ns.workers, mp_context=ctx) as ex:
            for job, st in zip(jobs, ex.map(_warm, jobs)):
                if st != "ok":
                    print(f"# warm {job}: {st}", flush=True)
    print(f"# compiled {len(jobs)} jobs in {time.time() - t_start:.1f} s", flush=True)

    dev = torch.device("cpu" if ns.smoke_cpu else "cuda")
    bw = 0.0 if ns.smoke_cpu else measure_copy_bandwidth("cuda")
    base = load_module(ns.baseline_module, "sweep_baseline_linear") if ns.baseline_module else None
    g = torch.Generator(device=dev).manual_seed(0)
    out: dict[str, Any] = dict(
        device="cpu (interpreter smoke)" if ns.smoke_cpu else torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
        copy_bandwidth_GBps=bw / 1e9,
        date_utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        cases=[],
    )
    print(f"# copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    hdr = (f"{'shape':<22} {'M':>4} {'bound':>7} {'before':>7} {'default':>8} {'aq':>7} {'fp32':>7} {'gemv':>7} "
           f"{'best':>7}  best config | default config")
    print(hdr, flush=True)
    for shape, m in itertools.product(SHAPES, tokens):
        case = Case(shape, m, bw, g, dev, ns.smoke_cpu)
        res: dict[str, Any] = dict(shape=case.name, N=case.n, K=case.k, M=m, calls_per_step=case.calls,
                                   bound_us=case.bound_us, candidates=[])  # fmt: skip
        res["default_config"] = lt.default_config(
            m, case.n, case.k, BLOCK[1], torch.bfloat16, ns.smoke_cpu
        ).__dict__
        res["default"] = case.measure(
            lambda x, q, s: lt.fp8_linear(x, q, s, BLOCK, act_quant=False), case.x, case.want, ns.smoke_cpu
        )
        res["default_act_quant"] = case.measure(
            lambda x, q, s: lt.fp8_linear(x, q, s, BLOCK, act_quant=True), case.x, case.want_aq, ns.smoke_cpu
        )
        if case.dtype == "fp32":
            res["default_fp32"] = case.measure(
                lambda x, q, s: lt.fp8_linear(x, q, s, BLOCK, act_quant=False),
                case.x32,
                case.want32,
                ns.smoke_cpu,
            )
        if base is not None:
            res["before"] = case.measure(
                lambda x, q, s: base.fp8_linear(x, q, s, BLOCK, act_quant=False),
                case.x,
                case.want,
                ns.smoke_cpu,
            )
            if case.dtype == "fp32":
                res["before_fp32"] = case.measure(
                    lambda x, q, s: base.fp8_linear(x, q, s, BLOCK, act_quant=False),
                    case.x32,
                    case.want32,
                    ns.smoke_cpu,
                )
        if not ns.defaults_only and time.time() - t_start < ns.budget_s:
            tiles = candidates(m)
            if ns.smoke_cpu:
                tiles = [(16, 16, 128, 4, 1, False, "group", 2), (16, 16, 64, 4, 1, True, "weight", 2),
                         (next_pow2(m), 16, 64, 4, 1, False, "fma", 2), (next_pow2(m), 16, 64, 4, 1, False, "gemv", 1),
                         (16, 64, 128, 4, 1, False, "frag", 2)]
                tiles = [t for t in tiles if t[6] in modes]
            for bm, bn, bk, w, st, swap, mode, pf in tiles:
                cfg = lt.LinearConfig(bm, bn, bk, w, st, 0, swap, mode, prefetch=pf)
                row = case.measure(
                    lambda x, q, s, cfg=cfg: lt.fp8_linear(x, q, s, BLOCK, act_quant=False, config=cfg),
                    case.x, case.want, ns.smoke_cpu,
                )  # fmt: skip
                res["candidates"].append(dict(config=cfg.__dict__, **row))
            # phase B: split counts and programs targets for the best tile, and for the best "gemv" tile
            timed = [c for c in res["candidates"] if "us" in c] or res["candidates"]
            bests = [min(timed, key=lambda c: c.get("us", 0.0))["config"]]
            gemv = [c for c in timed if c["config"]["mode"] == "gemv"]
            if gemv and bests[0]["mode"] != "gemv":
                bests.append(min(gemv, key=lambda c: c.get("us", 0.0))["config"])
            for best in bests:
                variants = [dict(best, split=sp, programs=0) for sp in SPLITS]
                variants += [dict(best, split=0, programs=pr) for pr in PROGRAMS]
                for conf in variants:
                    cfg = lt.LinearConfig(**conf)
                    row = case.measure(
                        lambda x, q, s, cfg=cfg: lt.fp8_linear(x, q, s, BLOCK, act_quant=False, config=cfg),
                        case.x, case.want, ns.smoke_cpu,
                    )  # fmt: skip
                    res["candidates"].append(dict(config=cfg.__dict__, **row))
        timed = sorted((c for c in res["candidates"] if "us" in c), key=lambda c: c["us"])
        if timed:
            res["best"] = timed[0]
        gemv_timed = [c for c in timed if c["config"]["mode"] == "gemv"]
        if gemv_timed:
            res["best_gemv"] = gemv_timed[0]
        # act_quant and (fp32 shapes) fp32 activations at the best few configs, and fp32 at the "fma" tiles
        res["act_quant"], res["fp32"] = [], []
        top = list({json.dumps(c["config"]): c["config"] for c in timed}.values())[:3]
        for conf in top:
            cfg = lt.LinearConfig(**conf)
            row = case.measure(
                lambda x, q, s, cfg=cfg: lt.fp8_linear(x, q, s, BLOCK, act_quant=True, config=cfg),
                case.x, case.want_aq, ns.smoke_cpu,
            )  # fmt: skip
            res["act_quant"].append(dict(config=conf, **row))
        if case.dtype == "fp32" and not ns.defaults_only:
            fma = [
                c["config"]
                for c in res["candidates"]
                if c["config"]["mode"] in ("fma", "gemv") and c["config"]["split"] == 0 and not c["config"]["programs"]
            ]
            for conf in fma + top[:1]:
                cfg = lt.LinearConfig(**conf)
                row = case.measure(
                    lambda x, q, s, cfg=cfg: lt.fp8_linear(x, q, s, BLOCK, act_quant=False, config=cfg),
                    case.x32, case.want32, ns.smoke_cpu,
                )  # fmt: skip
                res["fp32"].append(dict(config=conf, **row))
        out["cases"].append(res)

        def us(row: dict | None) -> str:
            return (
                "-"
                if row is None
                else f"{row['us']:.1f}"
                if "us" in row
                else "ERR"
                if "error" in row
                else "ok"
            )

        b = res.get("best")
        def conf_s(c: dict) -> str:
            return "LinearConfig(" + ", ".join(f"{k}={v!r}" for k, v in c.items()) + ")"

        cfg_s = "" if b is None else conf_s(b["config"])
        bound = f"{case.bound_us:.1f}" if case.bound_us else "-"
        print(f"{case.name:<22} {m:>4} {bound:>7} {us(res.get('before')):>7} {us(res['default']):>8} "
              f"{us(res['default_act_quant']):>7} {us(res.get('default_fp32')):>7} {us(res.get('best_gemv')):>7} "
              f"{us(b):>7}  {cfg_s} | {conf_s(res['default_config'])}", flush=True)  # fmt: skip
        if res.get("best_gemv") is not None and res["best_gemv"] is not b:
            print(f"#   best gemv: {conf_s(res['best_gemv']['config'])}", flush=True)
        for key in ("default", "default_act_quant", "default_fp32", "before"):
            if res.get(key, {}).get("error"):
                print(f"#   {key}: {res[key]['error']}", flush=True)
        out["wall_s"] = time.time() - t_start
        with open(
            ns.output_json, "w"
        ) as f:  # after every case: a run cut by a time limit keeps what it measured
            json.dump(out, f, indent=1)
    # per decode step (calls per step x time), per M
    for m in tokens:
        rows = [c for c in out["cases"] if c["M"] == m]
        tot = {}
        for key in ("bound", "before", "default", "best", "best_gemv"):
            vals = [(c["bound_us"] if key == "bound" else c.get(key, {}).get("us")) for c in rows]
            ok = bool(vals) and all(v is not None for v in vals)
            tot[key] = sum(c["calls_per_step"] * v for c, v in zip(rows, vals)) if ok else None
        out.setdefault("per_step_us", {})[m] = tot
        print(f"# per step M={m}: " + ", ".join(f"{k} {v:.0f} us" for k, v in tot.items() if v), flush=True)
    out["wall_s"] = time.time() - t_start
    with open(ns.output_json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"# wall {out['wall_s']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
