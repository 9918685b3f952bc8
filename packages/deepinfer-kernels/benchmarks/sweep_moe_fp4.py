"""Launch-config sweep of the FP4 grouped expert GEMMs (gate/up and down) on one CUDA GPU, V4.1-Flash widths.

For T tokens (top-6 of 384 experts, random routing, d 5120, I 2304) every candidate config of each kernel is
timed alone (triton.testing.do_bench median, L2 flushed), checked against the torch reference through the whole
expert path (the other kernel at its default), and set beside its bytes bound (weights + scales of the experts
hit / copy bandwidth measured in the same run). Prints the best configs per T, then a table of the old kernels
("asm" / "bits": whole-tile decode) against the per-scale-group kernels ("grouped*", docs/moe_fp4_kernel.md) per
T, kernel and the default whole-path time of each, and writes JSON.

--layout checkpoint,chunked times every config on both weight layouts (the checkpoint's bytes, and the chunked
layout of `deepinfer_kernels.moe.fp4_layout` that the engine can repack to at load) and prints them side by side;
every row is checked against the reference of the checkpoint-layout experts.

--gemv times the CUDA-core kernels (variants "gemv" / "gemv_expert", `deepinfer_kernels.moe.fp4_gemv`) on the
chunked layout instead: every gemv candidate (block_n, block_k, warps, num_stages 1 / 2 = no / register prefetch)
of each kernel, checked against the reference first (paired with the other kernel's reference gemv config), beside
the grouped default configs of the same T, then the whole path (permutation, both GEMMs, combine) of the best gemv
pair against the default, and the defaults it suggests.

    PYTHONPATH=packages/deepinfer-kernels/src python packages/deepinfer-kernels/benchmarks/sweep_moe_fp4.py \
        [--tokens 1,8,64,256] [--quick] [--layout checkpoint,chunked] [--gemv] [--json out.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from functools import partial

import torch
import triton
from deepinfer_kernels.device_rates import measure_copy_bandwidth
from deepinfer_kernels.moe import StackedExperts, reference
from deepinfer_kernels.moe import triton as mt
from deepinfer_kernels.moe.fp4_gemv import triton as fv
from triton.testing import do_bench

E, D, INTER, TOPK = 384, 5120, 2304, 6


def experts() -> StackedExperts:
    def packed(o, i):
        return torch.randint(-128, 128, (E, o, i // 2), dtype=torch.int8, device="cuda")

    def scale(o, i):
        return torch.randint(122, 126, (E, o, i // 32), dtype=torch.uint8, device="cuda").view(
            torch.float8_e8m0fnu
        )

    return StackedExperts(packed(INTER, D), packed(INTER, D), packed(D, INTER), scale(INTER, D), scale(INTER, D),
                          scale(D, INTER), fmt="fp4")  # fmt: skip


def candidates(quick: bool) -> list[mt.GemmConfig]:
    if quick:
        old = [mt.GemmConfig(64, 128, 4, 3, "asm"), mt.GemmConfig(128, 256, 8, 3, "asm")]
        new = [mt.GemmConfig(n, k, w, s, "grouped") for n, k, w, s in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 256, 8, 3))]
        # 128 registers: 4 CTAs per SM for the chunked gate/up kernel (149 registers uncapped, 3 CTAs)
        capped = [mt.GemmConfig(64, 128, 4, 4, "grouped", max_regs=128)]
        return old + new + capped + [mt.GemmConfig(64, 256, 4, 3, "grouped_exact")]
    grid = itertools.product((32, 64, 128), (128, 256, 512), (4, 8), (2, 3))
    asm = [mt.GemmConfig(n, k, w, s, "asm") for n, k, w, s in grid]
    grouped = [mt.GemmConfig(n, k, w, s, v) for v, n, k, w, s in
               itertools.product(("grouped",), (64, 128), (128, 256, 512), (4, 8), (2, 3, 4))]  # fmt: skip
    return asm + [mt.GemmConfig(64, 256, 4, 3, "bits")] + grouped + [mt.GemmConfig(64, 128, 4, 4, "grouped_exact")]


def gemv_candidates(quick: bool) -> list[mt.GemmConfig]:
    """(block_n, block_k, warps, stages) of the gemv kernels; a tile holds at least one 16-byte code vector a lane
    (block_n * block_k >= 1024 * warps), else lanes would hold copies."""
    if quick:
        tiles = [(16, 256, 4, 2), (32, 128, 4, 2), (32, 256, 4, 2), (32, 256, 4, 1), (32, 512, 4, 2), (64, 128, 4, 2),
                 (64, 256, 4, 2), (64, 256, 8, 2), (64, 512, 8, 2), (128, 256, 8, 2), (32, 256, 2, 2)]  # fmt: skip
        return [mt.GemmConfig(n, k, w, s, "gemv") for n, k, w, s in tiles] + [
            mt.GemmConfig(32, 256, 4, 2, "gemv_expert"), mt.GemmConfig(64, 256, 4, 2, "gemv_expert")
        ]  # fmt: skip
    grid = itertools.product((16, 32, 64, 128), (128, 256, 512), (2, 4, 8), (1, 2))
    tiles = [(n, k, w, s) for n, k, w, s in grid if n * k >= 1024 * w]
    return [mt.GemmConfig(n, k, w, s, v) for v in ("gemv", "gemv_expert") for n, k, w, s in tiles]


GEMV_EXPERT_SLOTS = 2  # block_m of "gemv_expert": an expert's pairs two at a time (more take several programs)


def run_gemv_case(st: StackedExperts, ck: StackedExperts, t: int, cands: list[mt.GemmConfig], bw: float,
                  limit: float) -> dict:  # fmt: skip
    """One T: the grouped default configs and every gemv candidate per kernel on the chunked experts ck (st: the
    same experts in the checkpoint layout, the reference's), then the whole path of the best gemv pair."""
    g = torch.Generator(device="cuda").manual_seed(t)
    x = (torch.randn(t, D, device="cuda", generator=g) / 8).bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:TOPK] for _ in range(t)])
    w = torch.rand(t, TOPK, device="cuda", generator=g)
    p = t * TOPK
    hit = int(torch.unique(ids).numel())
    want = reference.moe_experts(x, w, ids, st, limit)
    rw = w.reshape(-1).float().contiguous()
    rows = torch.empty((p, D), dtype=torch.float32, device="cuda")
    up_bytes = hit * 2 * (INTER * D // 2 + INTER * D // 32)
    down_bytes = hit * (INTER * D // 2 + INTER * D // 32)
    res = {"T": t, "layout": "chunked", "experts_hit": hit, "gate_up": [], "down": []}

    # the grouped defaults (what runs today), kernels alone
    block_m, d_up, d_down = mt.default_configs(p, False, False, chunked=True, gemv=False)
    pairs, bexp = mt.align_pairs(ids, E, block_m)
    hg = torch.empty((bexp.shape[0] * block_m, INTER), dtype=x.dtype, device="cuda")
    h_perm = d_down.variant.startswith("grouped")
    slots = {}  # variant -> (exp, pairs, block_t, h)
    for variant in ("gemv", "gemv_expert"):
        if variant == "gemv":
            slots[variant] = (ids.reshape(-1), None, 1)
        else:
            pp, ee = mt.align_pairs(ids, E, GEMV_EXPERT_SLOTS)
            slots[variant] = (ee, pp, GEMV_EXPERT_SLOTS)
        ex, _, bt = slots[variant]
        slots[variant] += (torch.empty((ex.shape[0] * bt, INTER), dtype=x.dtype, device="cuda"),)

    def up(cfg):
        if not cfg.variant.startswith("gemv"):
            mt.launch_gate_up(x, ck.w1, ck.w3, ck.s1, ck.s3, pairs, bexp, hg, TOPK, limit, block_m, cfg, False, h_perm,
                              True)  # fmt: skip
            return
        ex, pp, bt, h = slots[cfg.variant]
        fv.launch_gate_up(x, ck.w1, ck.w3, ck.s1, ck.s3, ex, pp, h, TOPK, limit, bt, cfg.block_n, cfg.block_k,
                          cfg.num_warps, cfg.num_stages > 1, True, True)  # fmt: skip

    def down(cfg):
        if not cfg.variant.startswith("gemv"):
            mt.launch_down(hg, ck.w2, ck.s2, pairs, bexp, rw, rows, block_m, cfg, False, True)
            return
        ex, pp, bt, h = slots[cfg.variant]
        fv.launch_down(h, ck.w2, ck.s2, ex, pp, rw, rows, bt, cfg.block_n, cfg.block_k, cfg.num_warps,
                       cfg.num_stages > 1, True, True)  # fmt: skip

    def partner(cfg, kind):  # the other kernel of a checked pair: the same family's reference config
        if not cfg.variant.startswith("gemv"):
            return d_down if kind == "gate_up" else d_up
        return mt.GemmConfig(64, 256, 4, 2, cfg.variant)

    for kind, fn, nbytes in (("gate_up", up, up_bytes), ("down", down, down_bytes)):
        for cfg in [d_up if kind == "gate_up" else d_down, *cands]:
            pair = (cfg if kind == "gate_up" else partner(cfg, kind), cfg if kind == "down" else partner(cfg, kind))
            row = time_config(cfg, fn, pair, up, down, rows, want, nbytes / bw * 1e3)
            row["grouped_default"] = not is_gemv(cfg)
            res[kind].append(row)

    args = (x, w, ids, ck.w1, ck.w3, ck.w2, ck.s1, ck.s3, ck.s2, limit)
    run = partial(mt.moe_experts_fp4, chunked=True)
    default = mt.default_configs(p, False, False, chunked=True, gemv=False)
    res["default_rel_err"] = rel(run(*args, configs=default), want)
    res["default_total_ms"] = do_bench(partial(run, *args, configs=default), warmup=5, rep=25)
    res["total_bound_ms"] = (up_bytes + down_bytes) / bw * 1e3
    best_pair = None
    for variant in ("gemv", "gemv_expert"):
        bu = best_of(res["gate_up"], variant)
        bd = best_of(res["down"], variant)
        if bu is None or bd is None:
            continue
        cfgs = (slots[variant][2], mt.GemmConfig(**bu["config"]), mt.GemmConfig(**bd["config"]))
        err = rel(run(*args, configs=cfgs), want)
        ms = do_bench(partial(run, *args, configs=cfgs), warmup=5, rep=25)
        res[f"{variant}_total"] = {"configs": [cfgs[0], cfgs[1].__dict__, cfgs[2].__dict__], "rel_err": err, "ms": ms}
        if err < 2e-2 and (best_pair is None or ms < best_pair["ms"]):
            best_pair = res[f"{variant}_total"]
    res["gemv_best_total"] = best_pair
    return res


def is_gemv(cfg: mt.GemmConfig) -> bool:
    return cfg.variant.startswith("gemv")


def best_of(rows: list[dict], variant: str) -> dict | None:
    ok = [r for r in rows if "ms" in r and r["rel_err"] < 2e-2 and r["config"]["variant"] == variant]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def print_gemv(cases: list[dict]) -> None:
    print("\n| T | kernel | bound us | grouped default | us | % | best gemv | us | % | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        for kind in ("gate_up", "down"):
            d = next((r for r in case[kind] if r["grouped_default"] and "ms" in r), None)
            ok = [r for r in case[kind] if not r["grouped_default"] and "ms" in r and r["rel_err"] < 2e-2]
            n = min(ok, key=lambda r: r["ms"]) if ok else None
            bound = case[kind][0]["bound_ms"] * 1e3
            cols = []
            for r in (d, n):
                cols += [fmt_cfg(r), f"{r['ms'] * 1e3:.1f}" if r else "-", f"{100 * r['of_bound']:.1f}" if r else "-"]
            speed = f"{d['ms'] / n['ms']:.2f}x" if d and n else "-"
            print(f"| {case['T']} | {kind} | {bound:.1f} | " + " | ".join(cols) + f" | {speed} |")
        b = case["gemv_best_total"]
        tb, od = case["total_bound_ms"] * 1e3, case["default_total_ms"] * 1e3
        if b:
            print(f"| {case['T']} | whole path | {tb:.1f} | default | {od:.1f} | {100 * tb / od:.1f} | "
                  f"{b['configs'][1]['variant']} (err {b['rel_err']:.1e}) | {b['ms'] * 1e3:.1f} | "
                  f"{100 * tb / (b['ms'] * 1e3):.1f} | {od / (b['ms'] * 1e3):.2f}x |")  # fmt: skip
    print("\nsuggested gemv defaults (whole path faster than the grouped default; rows of moe.triton.GEMV_TILES):")
    for case in cases:
        b = case["gemv_best_total"]
        win = b is not None and b["ms"] < case["default_total_ms"]
        cf = "" if b is None else (f" ({case['T'] * TOPK}, {b['configs'][0]}, {mt.GemmConfig(**b['configs'][1])}, "
                                   f"{mt.GemmConfig(**b['configs'][2])}): {b['ms'] * 1e3:.1f} vs "
                                   f"{case['default_total_ms'] * 1e3:.1f} us")  # fmt: skip
        print(f"  T={case['T']}: {'gemv' if win else 'grouped'}{cf}")


def is_new(cfg: mt.GemmConfig) -> bool:
    return cfg.variant.startswith("grouped")


def time_config(cfg: mt.GemmConfig, fn, pair: tuple, up, down, rows: torch.Tensor, want: torch.Tensor,
                bound_ms: float) -> dict:
    """One sweep row: the expert path run once with (gate/up, down) configs `pair` and checked against `want`
    (rows [T * k, d] cleared first, so a kernel that writes nothing cannot pass), then `fn(cfg)` timed; a config
    that does not compile or fit is recorded as an error row."""
    row = {"config": cfg.__dict__, "bound_ms": bound_ms}
    try:
        rows.fill_(float("nan"))
        up(pair[0])
        down(pair[1])
        row["rel_err"] = rel(rows.view(-1, TOPK, D).sum(1), want)
        row["ms"] = do_bench(partial(fn, cfg), warmup=5, rep=25)
        row["of_bound"] = row["bound_ms"] / row["ms"]
    except Exception as exc:  # noqa: BLE001 - a config that does not compile / fit is a sweep result
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


def run_case(
    st: StackedExperts, t: int, cands: list[mt.GemmConfig], bw: float, limit: float, layout: str = "checkpoint"
) -> dict:
    """One T on one weight layout; st: the checkpoint-layout experts (the reference's), repacked here for
    layout "chunked"."""
    ref = st
    chunked = layout == "chunked"
    if chunked:
        st = st.chunked()
    g = torch.Generator(device="cuda").manual_seed(t)
    x = (torch.randn(t, D, device="cuda", generator=g) / 8).bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda", generator=g)[:TOPK] for _ in range(t)])
    w = torch.rand(t, TOPK, device="cuda", generator=g)
    hit = int(torch.unique(ids).numel())
    want = reference.moe_experts(x, w, ids, ref, limit)
    block_m, d_up, d_down = mt.default_configs(t * TOPK, False, False, chunked=chunked)
    new_defaults = mt.default_configs(t * TOPK, False, False, grouped=True, chunked=chunked)
    _, n_up, n_down = new_defaults
    pairs, bexp = mt.align_pairs(ids, E, block_m)
    h = torch.empty((bexp.shape[0] * block_m, INTER), dtype=x.dtype, device="cuda")
    rows = torch.empty((t * TOPK, D), dtype=torch.float32, device="cuda")
    rw = w.reshape(-1).float().contiguous()
    up_bytes = hit * 2 * (INTER * D // 2 + INTER * D // 32)
    down_bytes = hit * (INTER * D // 2 + INTER * D // 32)

    def up(cfg):  # a grouped gate/up writes h in the order the grouped down kernel reads
        mt.launch_gate_up(x, st.w1, st.w3, st.s1, st.s3, pairs, bexp, h, TOPK, limit, block_m, cfg, False, is_new(cfg),
                          chunked)  # fmt: skip

    def down(cfg):
        mt.launch_down(h, st.w2, st.s2, pairs, bexp, rw, rows, block_m, cfg, False, chunked)

    res = {"T": t, "layout": layout, "experts_hit": hit, "block_m": block_m, "gate_up": [], "down": []}
    for kind, fn, nbytes in (("gate_up", up, up_bytes), ("down", down, down_bytes)):
        for cfg in cands:
            pair = (cfg if kind == "gate_up" else (n_up if is_new(cfg) else d_up),
                    cfg if kind == "down" else (n_down if is_new(cfg) else d_down))
            res[kind].append(time_config(cfg, fn, pair, up, down, rows, want, nbytes / bw * 1e3))
    args = (x, w, ids, st.w1, st.w3, st.w2, st.s1, st.s3, st.s2, limit)
    run = partial(mt.moe_experts_fp4, chunked=chunked)
    res["default_rel_err"] = rel(run(*args), want)
    res["default_total_ms"] = do_bench(partial(run, *args), warmup=5, rep=25)
    got = run(*args, configs=new_defaults)
    res["grouped_default_rel_err"] = rel(got, want)
    res["grouped_default_total_ms"] = do_bench(partial(run, *args, configs=new_defaults), rep=25)
    res["total_bound_ms"] = (up_bytes + down_bytes) / bw * 1e3
    return res


def best(rows: list[dict], new: bool) -> dict | None:
    ok = [r for r in rows if "ms" in r and r["rel_err"] < 2e-2 and r["config"]["variant"].startswith("grouped") == new]
    return min(ok, key=lambda r: r["ms"]) if ok else None


def fmt_cfg(r: dict | None) -> str:
    if r is None:
        return "-"
    c = r["config"]
    regs = f" r{c['max_regs']}" if c.get("max_regs") else ""
    return f"{c['variant']} n{c['block_n']} k{c['block_k']} w{c['num_warps']} s{c['num_stages']}{regs}"


def print_old_vs_new(cases: list[dict]) -> None:
    print("\n| T | kernel | bound us | old best | old us | old % | new best | new us | new % | speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in cases:
        for kind in ("gate_up", "down"):
            o, n = best(case[kind], False), best(case[kind], True)
            bound = case[kind][0]["bound_ms"] * 1e3
            cols = []
            for r in (o, n):
                cols += [fmt_cfg(r), f"{r['ms'] * 1e3:.1f}" if r else "-", f"{100 * r['of_bound']:.1f}" if r else "-"]
            speed = f"{o['ms'] / n['ms']:.2f}x" if o and n else "-"
            print(f"| {case['T']} {case['layout']} | {kind} | {bound:.1f} | " + " | ".join(cols) + f" | {speed} |")
        tb = case["total_bound_ms"] * 1e3
        od, nd = case["default_total_ms"] * 1e3, case["grouped_default_total_ms"] * 1e3
        print(f"| {case['T']} {case['layout']} | whole path, defaults (grouped=False / True) | {tb:.1f} | default | {od:.1f} | "
              f"{100 * tb / od:.1f} | grouped default (err {case['grouped_default_rel_err']:.1e}) | {nd:.1f} | "
              f"{100 * tb / nd:.1f} | {od / nd:.2f}x |")  # fmt: skip


def print_layouts(cases: list[dict]) -> None:
    """Checkpoint vs chunked layout, config by config (the same T), and the whole-path defaults."""
    by = {(c["T"], c["layout"]): c for c in cases}
    pairs = [(by[(t, "checkpoint")], by[(t, "chunked")]) for t, lay in by if lay == "checkpoint" and (t, "chunked") in by]
    if not pairs:
        return
    print("\n| T | kernel | config | checkpoint us | chunked us | speedup | chunked err |")
    print("|---|---|---|---|---|---|---|")
    for a, b in pairs:
        for kind in ("gate_up", "down"):
            for ra, rb in zip(a[kind], b[kind], strict=True):
                ta = f"{ra['ms'] * 1e3:.1f}" if "ms" in ra else ra.get("error", "-")[:30]
                tb = f"{rb['ms'] * 1e3:.1f}" if "ms" in rb else rb.get("error", "-")[:30]
                sp = f"{ra['ms'] / rb['ms']:.2f}x" if "ms" in ra and "ms" in rb else "-"
                err = f"{rb['rel_err']:.1e}" if "rel_err" in rb else "-"
                print(f"| {a['T']} | {kind} | {fmt_cfg(ra)} | {ta} | {tb} | {sp} | {err} |")
        for key, name in (("default_total_ms", "default"), ("grouped_default_total_ms", "grouped default")):
            ea = a[key.replace("total_ms", "rel_err")]
            eb = b[key.replace("total_ms", "rel_err")]
            print(f"| {a['T']} | whole path | {name} | {a[key] * 1e3:.1f} | {b[key] * 1e3:.1f} | "
                  f"{a[key] / b[key]:.2f}x | {eb:.1e} (checkpoint {ea:.1e}) |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,1,256,8")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--layout", default="checkpoint", help="comma list of checkpoint, chunked")
    ap.add_argument("--gemv", action="store_true", help="the CUDA-core gemv kernels vs the grouped defaults (chunked)")
    args = ap.parse_args()
    layouts = args.layout.split(",")
    if not set(layouts) <= {"checkpoint", "chunked"}:
        ap.error(f"--layout {args.layout!r}: expected a comma list of checkpoint, chunked")
    t0 = time.time()
    bw = measure_copy_bandwidth("cuda")
    st = experts()
    cands = candidates(args.quick)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "copy_bandwidth_GBps": bw / 1e9, "cases": []}  # fmt: skip
    if args.gemv:
        main_gemv(args, out, st, bw, t0)
        return
    for t, layout in itertools.product((int(v) for v in args.tokens.split(",")), layouts):
        case = run_case(st, t, cands, bw, 10.0, layout)
        out["cases"].append(case)
        print(f"T={t} layout={layout} hit={case['experts_hit']} default total {case['default_total_ms']:.3f} ms "
              f"(bound {case['total_bound_ms']:.3f} ms, err {case['default_rel_err']:.1e})", flush=True)  # fmt: skip
        print_best(case, width=28, failed=3)
        print_old_vs_new([case])
        out["wall_s"] = time.time() - t0
        print(f"wall {out['wall_s']:.0f} s", flush=True)
        if args.json:  # after every case: a run cut by a time limit keeps what it measured
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    print("\nall T:", end="")
    print_old_vs_new(out["cases"])
    print_layouts(out["cases"])


def print_best(case: dict, *, width: int, failed: int) -> None:
    """Per GEMM of one case: the 6 fastest configurations that matched the reference, then the first failures."""
    for kind in ("gate_up", "down"):
        ok = sorted((r for r in case[kind] if "ms" in r and r["rel_err"] < 2e-2), key=lambda r: r["ms"])
        bad = [r for r in case[kind] if "ms" not in r or r["rel_err"] >= 2e-2]
        for r in ok[:6]:
            print(f"  {kind:7s} {fmt_cfg(r):{width}s}  {r['ms'] * 1e3:8.1f} us  bound {r['bound_ms'] * 1e3:7.1f} us  "
                  f"{100 * r['of_bound']:5.1f}%  err {r['rel_err']:.1e}")  # fmt: skip
        for r in bad[:failed]:
            print(f"  {kind:7s} FAILED {r['config']} {r.get('error') or r.get('rel_err')}")


def main_gemv(args: argparse.Namespace, out: dict, st: StackedExperts, bw: float, t0: float) -> None:
    ck = st.chunked()
    cands = gemv_candidates(args.quick)
    for t in (int(v) for v in args.tokens.split(",")):
        case = run_gemv_case(st, ck, t, cands, bw, 10.0)
        out["cases"].append(case)
        print(f"T={t} hit={case['experts_hit']} default total {case['default_total_ms'] * 1e3:.1f} us "
              f"(bound {case['total_bound_ms'] * 1e3:.1f} us, err {case['default_rel_err']:.1e})", flush=True)  # fmt: skip
        print_best(case, width=32, failed=4)
        out["wall_s"] = time.time() - t0
        print(f"wall {out['wall_s']:.0f} s", flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
    print("\nall T:", end="")
    print_gemv(out["cases"])


if __name__ == "__main__":
    main()
