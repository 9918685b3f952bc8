"""Programmatic dependent launch (PDL) in a CUDA-graphed B = 1 decode chain: FP8 "gemv" linears and RMSNorms.

The chain is one V4.1 layer's FP8 linears at their real widths (hidden 5120, 32 x 32 UE8M0 blocks; the shapes of
docs/perf.md "FP8 linear: the gemv mode", with the same-input pairs fused as the model runs them) interleaved with
its RMSNorms, repeated for `--layers` layers, each layer with its own weights:

    attn_norm -> wq_a+wkv [1792 x 5120] -> q_norm [1280] -> wq_b [32768 x 1280] -> indexer.wq_b [4096 x 1280]
    -> wo_a (8 groups of [1024 x 4096], one launch) -> wo_b [5120 x 8192] -> ffn_norm -> shared w1+w3 [4608 x 5120]
    -> shared w2 [5120 x 2304] -> the next layer

(the attention, the activation and the experts between them are left out; a linear reads the previous output or a
slice of it). The same chain is captured in CUDA graphs once per variant (`--variants`: pdl off, pdl on, and pdl on
with the gemv's PDL knobs `LinearConfig.pdl_trigger` / `pdl_l2_tiles` changed) and weight set (`--sets`; one set of
4 layers is ~670 MB, far above the 50 MB L2, so every replay streams its weights from DRAM), and the graphs are
replayed in rotation. Checks: the first variant's graph reproduces the eager chain bit for bit, and every
variant's outputs of every launch equal the first variant's bit for bit (before and after the timed replays). Also timed: the gemv-only chain (no norms between
the linears), and per shape a graph of `--per-shape` launches of that linear over distinct weights reading one
input (no data dependency; PDL still orders them).

Printed: µs per chain per variant (median over interleaved trials), µs per launch, the bytes bound (weight + scale + activation
bytes over the device copy bandwidth measured in the same run) and the share of it reached; `--output-json` writes
the same. One H200: well under 90 s.

    PYTHONPATH=packages/deepinfer-kernels/src python packages/deepinfer-kernels/benchmarks/bench_pdl_chain.py \
        [--layers 4] [--sets 2] [--per-shape 16] [--output-json bench_pdl_chain.json]

`--smoke-cpu` runs the chain logic at 1/32 of the widths on the Triton CPU interpreter (no graphs, no timing):
every variant must agree bit for bit with the first (there the wait is compiled out, docs/pdl.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from deepinfer_kernels.device_rates import measure_copy_bandwidth

BLOCK = (32, 32)
HIDDEN = 5120
Q_RANK = 1280
O_GROUPS = 8
EPS = 1e-6


@dataclass(frozen=True)
class Linear:
    name: str
    n: int
    k: int
    groups: int = 1


# one layer's FP8 linears at B = 1, in chain order (n = output rows of the whole weight)
LAYER = [
    Linear("attn.wq_a+wkv", 1280 + 512, HIDDEN),
    Linear("attn.wq_b", 32768, Q_RANK),
    Linear("indexer.wq_b", 4096, Q_RANK),
    Linear("attn.wo_a", O_GROUPS * 1024, 32768 // O_GROUPS, O_GROUPS),
    Linear("attn.wo_b", HIDDEN, O_GROUPS * 1024),
    Linear("shared.w1+w3", 2 * 2304, HIDDEN),
    Linear("shared.w2", HIDDEN, 2304),
]


@dataclass(frozen=True)
class Variant:
    """One way to launch the chain: pdl off / on, and `LinearConfig` overrides of the gemv launches' PDL knobs
    (where the next kernel may launch, how many K tiles go to L2 before the wait)."""

    name: str
    pdl: bool
    fields: tuple[tuple[str, object], ...] = ()


VARIANTS = [
    Variant("off", False),
    Variant("on", True),
    Variant("on trigger=loop", True, (("pdl_trigger", "loop"),)),
    Variant("on trigger=none", True, (("pdl_trigger", "none"),)),
    Variant("on l2=2", True, (("pdl_l2_tiles", 2),)),
    Variant("on l2=4", True, (("pdl_l2_tiles", 4),)),
    Variant("on l2=all", True, (("pdl_l2_tiles", 64),)),
    Variant("on trigger=loop l2=4", True, (("pdl_trigger", "loop"), ("pdl_l2_tiles", 4))),
]


def gemv_config(lin: Linear, variant: Variant):
    """The default launch config of this linear at M = 1 with the variant's overrides (gemv configs only)."""
    from deepinfer_kernels.linear import triton as lt

    cfg = lt.default_config(1, lin.n, lin.k, BLOCK[1], torch.bfloat16)
    return dataclasses.replace(cfg, **dict(variant.fields)) if cfg.mode == "gemv" else cfg


def launch_linear(lin: Linear, x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, counters: torch.Tensor,
                  variant: Variant) -> torch.Tensor:  # fmt: skip
    """x [1, groups * k] bf16 -> [1, n] through the Triton launcher with the variant's config and pdl."""
    from deepinfer_kernels.linear import triton as lt

    cfg = gemv_config(lin, variant)
    if lin.groups > 1:
        y = lt.fp8_linear_grouped(x.view(1, lin.groups, lin.k), q, s, BLOCK, act_quant=False, config=cfg,
                                  counters=counters, pdl=variant.pdl)  # fmt: skip
        return y.reshape(1, lin.n)
    return lt.fp8_linear(x, q, s, BLOCK, act_quant=False, config=cfg, counters=counters, pdl=variant.pdl)


def scaled(lin: Linear, div: int) -> Linear:
    """The same linear at 1/div of every width (CPU smoke run); groups kept."""
    return Linear(lin.name, lin.n // div, lin.k // div, lin.groups)


def _linear_bytes(lin: Linear) -> int:
    """Weight, UE8M0 scale and bf16 activation bytes of one launch (x: groups x k values)."""
    return lin.n * lin.k + -(-lin.n // BLOCK[0]) * -(-lin.k // BLOCK[1]) + 2 * (lin.groups * lin.k + lin.n)


def random_fp8(n: int, k: int, g: torch.Generator, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 codes (no NaN codes) and UE8M0 block scales chosen so that y = x Wᵀ keeps about x's RMS: the
    chain's values stay O(1) over its ~40 launches (a finite output is checked)."""
    w = torch.randint(-126, 127, (n, k), generator=g, dtype=torch.int8, device=dev)
    w = torch.where((w & 0x7F) == 0x7F, torch.zeros_like(w), w)
    q = w.view(torch.float8_e4m3fn)
    rms = float(q[: min(n, 256)].float().pow(2).mean().sqrt())
    e = round(-math.log2(rms * math.sqrt(k)))
    sb = torch.randint(126 + e, 128 + e, (-(-n // BLOCK[0]), -(-k // BLOCK[1])), generator=g, dtype=torch.uint8,
                       device=dev)  # fmt: skip
    return q, sb.view(torch.float8_e8m0fnu)


class Chain:
    """Weights of `layers` layers and the ops of one decode chain over them."""

    def __init__(self, layers: int, dev: torch.device, g: torch.Generator, div: int = 1) -> None:
        self.dev = dev
        self.lins = [scaled(lin, div) for lin in LAYER]
        self.hidden, self.q_rank = HIDDEN // div, Q_RANK // div
        self.w = [[random_fp8(lin.n, lin.k, g, dev) for lin in self.lins] for _ in range(layers)]
        self.norm_w = [[(1 + 0.1 * torch.randn(d, generator=g, device=dev)).bfloat16()
                        for d in (self.hidden, self.q_rank, self.hidden)] for _ in range(layers)]  # fmt: skip
        from deepinfer_kernels.linear import split_k_counters

        self.counters = split_k_counters(dev)

    def linear(self, i: int, layer: int, x: torch.Tensor, v: Variant) -> torch.Tensor:
        q, s = self.w[layer][i]
        return launch_linear(self.lins[i], x, q, s, self.counters, v)

    def norm(self, j: int, layer: int, x: torch.Tensor, v: Variant) -> torch.Tensor:
        from deepinfer_kernels.norm_rope import rms_norm

        return rms_norm(x, self.norm_w[layer][j], EPS, backend="triton", pdl=v.pdl)

    def run(self, x: torch.Tensor, v: Variant, norms: bool) -> list[torch.Tensor]:
        """One chain from x [1, hidden] bf16 launched as variant v; every launch's output, in order."""
        outs: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            outs.append(t)
            return t

        h = x
        for layer in range(len(self.w)):
            a = keep(self.norm(0, layer, h, v)) if norms else h
            qkv = keep(self.linear(0, layer, a, v))
            q = qkv[:, : self.q_rank]
            if norms:
                q = keep(self.norm(1, layer, q, v))
            qh = keep(self.linear(1, layer, q, v))
            keep(self.linear(2, layer, q, v))
            o = keep(self.linear(3, layer, qh, v))
            h = keep(self.linear(4, layer, o, v))
            f = keep(self.norm(2, layer, h, v)) if norms else h
            w13 = keep(self.linear(5, layer, f, v))
            h = keep(self.linear(6, layer, w13[:, : w13.shape[1] // 2], v))
        return outs

    def bytes_moved(self, norms: bool) -> int:
        """Weight + scale + activation bytes one chain reads and writes (bf16 activations, UE8M0 scales)."""
        per_layer = sum(_linear_bytes(lin) for lin in self.lins)
        if norms:
            per_layer += sum(3 * 2 * d for d in (self.hidden, self.q_rank, self.hidden))  # x, y, weight
        return per_layer * len(self.w)


def capture(fn: Callable[[], list[torch.Tensor]]) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    fn()  # compile + warm outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, outs


def time_modes(graphs: dict[str, list[torch.cuda.CUDAGraph]], reps: int, trials: int) -> dict[str, float]:
    """Median µs per replay of each mode's graphs (replayed in rotation over the weight sets), the modes'
    trials interleaved so that clock and thermal drift hit all alike."""
    samples: dict[str, list[float]] = {m: [] for m in graphs}
    for _ in range(trials):
        for mode, gs in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                for gr in gs:
                    gr.replay()
            end.record()
            end.synchronize()
            samples[mode].append(start.elapsed_time(end) * 1e3 / (reps * len(gs)))
    return {m: statistics.median(v) for m, v in samples.items()}


def check_equal(name: str, a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    if len(a) != len(b):
        raise SystemExit(f"{name}: {len(a)} outputs vs {len(b)}")
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if not torch.equal(x, y):
            d = (x.float() - y.float()).abs().max().item()
            raise SystemExit(f"{name}: output {i} differs (max |Δ| {d:.3e}); pdl changed the results")
    if not all(bool(torch.isfinite(t.float()).all()) for t in a):
        raise SystemExit(f"{name}: non-finite outputs (weight scales of the benchmark are off)")


def smoke_cpu(variants: list[Variant]) -> None:
    """The chain at 1/32 widths on the interpreter: eager, every variant bit for bit equal to the first."""
    os.environ["TRITON_INTERPRET"] = "1"
    g = torch.Generator().manual_seed(0)
    chain = Chain(1, torch.device("cpu"), g, div=32)
    x = torch.randn(1, chain.hidden, generator=g).bfloat16()
    for norms in (True, False):
        first = chain.run(x, variants[0], norms)
        for v in variants[1:]:
            check_equal(f"smoke norms={norms} {v.name}", chain.run(x, v, norms), first)
        print(f"smoke norms={norms}: {len(first)} launches, {len(variants)} variants bit for bit equal")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--sets", type=int, default=2, help="weight sets replayed in rotation (cold weights)")
    ap.add_argument("--per-shape", type=int, default=16, help="launches per single-shape graph (0: skip)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--trials", type=int, default=9)
    ap.add_argument("--output-json", default="")
    ap.add_argument("--variants", default=",".join(v.name for v in VARIANTS),
                    help="comma-separated names of VARIANTS; the first is the baseline of the checks")
    ap.add_argument("--smoke-cpu", action="store_true")
    ns = ap.parse_args()
    table = {v.name: v for v in VARIANTS}
    variants = [table[name.strip()] for name in ns.variants.split(",")]
    if ns.smoke_cpu:
        smoke_cpu(variants)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_pdl_chain: needs a CUDA device (or --smoke-cpu)")
    from deepinfer_kernels._pdl import triton_has_pdl, use_pdl

    t0 = time.perf_counter()
    dev = torch.device("cuda")
    pdl_on = use_pdl(True, dev, interpreted=False)
    import triton

    meta = {
        "device": torch.cuda.get_device_name(dev), "capability": list(torch.cuda.get_device_capability(dev)),
        "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
        "python": platform.python_version(), "triton_has_pdl": triton_has_pdl(), "pdl_used": pdl_on,
        "layers": ns.layers, "sets": ns.sets, "reps": ns.reps, "trials": ns.trials,
    }  # fmt: skip
    print("# " + json.dumps(meta), flush=True)
    if not pdl_on:
        print("# WARNING: PDL is not available here: the 'on' rows launch plainly", flush=True)
    bw = measure_copy_bandwidth("cuda")
    print(f"# copy bandwidth {bw / 1e9:.1f} GB/s", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    chains = [Chain(ns.layers, dev, g) for _ in range(ns.sets)]
    x = torch.randn(1, HIDDEN, generator=g, device=dev).bfloat16()
    print(f"# weights ready at {time.perf_counter() - t0:.1f} s", flush=True)
    base = variants[0].name
    names = [v.name for v in variants]

    def print_row(r: dict) -> None:
        us = r["us"]
        best = min(us, key=us.get)
        cells = [f"{us[base]:.1f}"] + [f"{us[n]:.1f} ({(us[n] / us[base] - 1) * 100:+.1f}%)" for n in names[1:]]
        print(f"| {r['name']} | {r['launches']} | {r['bound_us']:.1f} | " + " | ".join(cells)
              + f" | {best} | {r['bound_us'] / us[best]:.1%} |", flush=True)

    print("\n| graph | launches | bound µs | " + " | ".join(f"µs {n}" for n in names) + " | best | best of bound |")
    print("|---|---|---|" + "---|" * len(names) + "---|---|", flush=True)
    rows = []
    for norms in (True, False):
        label = "norm+gemv chain" if norms else "gemv-only chain"
        graphs: dict[str, list[torch.cuda.CUDAGraph]] = {v.name: [] for v in variants}
        keep = []
        for i, ch in enumerate(chains):
            eager = ch.run(x, variants[0], norms)
            outs = {}
            for v in variants:
                gr, outs[v.name] = capture(lambda ch=ch, v=v, norms=norms: ch.run(x, v, norms))
                graphs[v.name].append(gr)
            check_equal(f"{label} set {i} graph {base} vs eager", outs[base], eager)
            for v in variants[1:]:
                check_equal(f"{label} set {i} {v.name} vs {base}", outs[v.name], outs[base])
            keep.append(outs)
        launches = len(keep[0][base])
        us = time_modes(graphs, ns.reps, ns.trials)
        # the outputs again after the timed replays: a race would show up as a difference
        for i, outs in enumerate(keep):
            for v in variants[1:]:
                check_equal(f"{label} set {i} {v.name} after timing", outs[v.name], outs[base])
        bound = chains[0].bytes_moved(norms) / bw * 1e6
        rows.append(dict(name=label, launches=launches, us=us, bound_us=bound))
        print_row(rows[-1])
        del graphs, keep
    shape_rows = []
    if ns.per_shape:
        for lin in LAYER:
            ws = [random_fp8(lin.n, lin.k, g, dev) for _ in range(ns.per_shape)]
            xi = torch.randn(1, lin.k * lin.groups, generator=g, device=dev).bfloat16()
            cnt = chains[0].counters
            graphs = {}
            outs = {}
            for v in variants:
                gr, outs[v.name] = capture(
                    lambda lin=lin, ws=ws, xi=xi, cnt=cnt, v=v: [launch_linear(lin, xi, q, s, cnt, v) for q, s in ws])
                graphs[v.name] = [gr]
            for v in variants[1:]:
                check_equal(f"{lin.name} x{ns.per_shape} {v.name} vs {base}", outs[v.name], outs[base])
            us = time_modes(graphs, max(2, ns.reps // 4), ns.trials)
            shape_rows.append(dict(name=f"{lin.name} [{lin.n} x {lin.k}]", launches=ns.per_shape, us=us,
                                   bound_us=ns.per_shape * _linear_bytes(lin) / bw * 1e6))
            print_row(shape_rows[-1])
            del graphs, outs, ws
    print(f"\nµs per launch ({base}): " + ", ".join(f"{r['name']} {r['us'][base] / r['launches']:.2f}" for r in rows))
    wall = time.perf_counter() - t0
    print(f"\n# wall {wall:.1f} s; every variant's outputs equal the {base} ones bit for bit in every graph", flush=True)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(dict(meta, copy_GBps=bw / 1e9, chains=rows, per_shape=shape_rows, wall_s=wall), f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
