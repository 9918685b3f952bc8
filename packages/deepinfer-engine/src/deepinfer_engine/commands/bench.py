"""`deepinfer bench throughput | latency | serving`: benchmark the engine (default: the embedded tiny model on CPU),
or an OpenAI-compatible server (`serving`: one at --url, or one started in this process)."""

from __future__ import annotations

import argparse

from deepinfer_engine.config import add_engine_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_kind", metavar="KIND", required=True)
    t = sub.add_parser("throughput", help="many random prompts at once: requests/s and tokens/s", allow_abbrev=False)
    t.add_argument("--num-prompts", type=int, default=16)
    t.add_argument("--input-len", type=int, default=32)
    t.add_argument("--output-len", type=int, default=32)
    t.add_argument("--workload", choices=("random", "shared-prefix"), default="random",
                   help="random prompts, or prompts sharing their first --shared-fraction (run with the prefix "
                        "cache on and off, TTFT / throughput / hit rate of each)")
    t.add_argument("--shared-fraction", type=float, default=0.9, help="shared-prefix: fraction of --input-len shared")
    srv = sub.add_parser("serving", help="concurrent streamed requests to an OpenAI-compatible server: TTFT, TPOT, "
                                          "inter-chunk latency, throughput", allow_abbrev=False)
    srv.add_argument("--url", default=None,
                     help="the server (e.g. http://127.0.0.1:8000); default: start one in this process over --model")
    srv.add_argument("--num-prompts", type=int, default=32)
    srv.add_argument("--input-len", type=int, default=32)
    srv.add_argument("--output-len", type=int, default=32)
    srv.add_argument("--concurrency", type=int, default=8,
                     help="closed loop: clients, each with one request in flight; with --request-rate: the most "
                          "requests in flight")
    srv.add_argument("--request-rate", type=float, default=None,
                     help="open loop: requests arrive as a Poisson process of this rate (req/s); default: closed loop")
    srv.add_argument("--served-model-name", default="deepinfer", help="the body's `model` field")
    lat = sub.add_parser("latency", help="one batch generated repeatedly: latency percentiles",
                         allow_abbrev=False)
    lat.add_argument("--batch-size", type=_int_list, default=[4],
                     help="batch size, or a comma list (each gets a latency block and a decode-step row)")
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=32)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--decode-steps", type=int, default=16,
                     help="timed decode steps per batch size for the bytes-bound table (0: skip the table)")
    lat.add_argument("--decode-repeats", type=int, default=1,
                     help="measure each batch size's decode steps this many times; the table shows the median of "
                          "the repeats' medians and their range (the step drifts as the device heats)")
    lat.add_argument("--plot", help="draw decode step time vs batch size against the bytes bound into this PNG")
    for p in (t, lat, srv):
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--bench-seed", type=int, default=0, help="seed of the random prompts")
        p.add_argument("--output-json", help="also write the result as JSON here")
        add_engine_args(p)


def _int_list(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"found {text!r}, expected an integer or a comma list of integers") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"found {text!r}, expected positive integers")
    return vals


def run(ns: argparse.Namespace) -> int:
    from deepinfer_engine import bench
    from deepinfer_engine.commands.output_file import check_output_path
    from deepinfer_engine.errors import ConfigError
    from deepinfer_engine.llm import llm_from_cli

    if getattr(ns, "decode_repeats", 1) < 1:
        raise ConfigError(f"decode_repeats: found {ns.decode_repeats}, expected a positive count (1 = measure once)")
    if getattr(ns, "plot", None):
        bench.check_plot_target(ns.plot)
    if ns.output_json:
        check_output_path(ns.output_json, option="output_json")  # before the run, not after it
    if ns.bench_kind == "serving":
        return _serving(ns)
    if ns.bench_kind == "throughput" and ns.workload == "shared-prefix":
        if not 0.0 <= ns.shared_fraction <= 1.0:
            raise ConfigError(f"shared_fraction: found {ns.shared_fraction}, expected a number in [0, 1]")
        r = bench.shared_prefix(lambda on: llm_from_cli(ns, enable_prefix_caching=on), num_prompts=ns.num_prompts,
                                input_len=ns.input_len, output_len=ns.output_len, shared_fraction=ns.shared_fraction,
                                temperature=ns.temperature, seed=ns.bench_seed)
        print(bench.format_result(r))
        if ns.output_json:
            bench.write_json(r, ns.output_json)
        return 0
    llm = llm_from_cli(ns)
    try:
        return _run(llm, ns)
    finally:
        llm.close()  # data-parallel rank processes


def _run(llm, ns: argparse.Namespace) -> int:
    from deepinfer_engine import bench

    if ns.bench_kind == "throughput":
        r = bench.throughput(llm, num_prompts=ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
                             temperature=ns.temperature, seed=ns.bench_seed)
        print(bench.format_result(r))
    else:
        blocks = []
        for b in ns.batch_size:
            blocks.append(bench.latency(llm, batch_size=b, input_len=ns.input_len, output_len=ns.output_len,
                                        num_iters=ns.num_iters, num_iters_warmup=ns.num_iters_warmup,
                                        temperature=ns.temperature, seed=ns.bench_seed))
            print(bench.format_result(blocks[-1]))
        r = blocks[0] if len(blocks) == 1 else {"benchmark": "latency", "runs": blocks}
        if ns.decode_steps > 0:
            roof = bench.decode_roofline(llm, batch_sizes=ns.batch_size, input_len=ns.input_len,
                                         steps=ns.decode_steps, seed=ns.bench_seed, repeats=ns.decode_repeats)
            print(bench.format_roofline(roof))
            r = {**r, "decode_roofline": roof}
            if ns.plot:
                bench.plot_roofline(roof, ns.plot)
    if ns.output_json:
        bench.write_json(r, ns.output_json)
    return 0


def _serving(ns: argparse.Namespace) -> int:
    from deepinfer_engine import bench
    from deepinfer_engine.bench_serving import format_serving, run_serving
    from deepinfer_engine.errors import ConfigError
    from deepinfer_engine.llm import llm_from_cli
    from deepinfer_engine.server import serve_in_thread

    for name in ("num_prompts", "input_len", "output_len", "concurrency"):
        if getattr(ns, name) < 1:
            raise ConfigError(f"{name}: found {getattr(ns, name)}, expected >= 1")
    if ns.request_rate is not None and not ns.request_rate > 0:
        raise ConfigError(f"request_rate: found {ns.request_rate}, expected a positive rate (req/s) or no flag")
    llm = stop = None
    url, vocab = ns.url, 129280
    if url is None:
        llm = llm_from_cli(ns)
        vocab = int(getattr(llm.engine.args, "vocab_size", vocab))
        url, stop = serve_in_thread(llm, model_name=ns.served_model_name)
    try:
        r = run_serving(url, num_prompts=ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
                        concurrency=ns.concurrency, vocab_size=vocab, temperature=ns.temperature,
                        seed=ns.bench_seed, model=ns.served_model_name, request_rate=ns.request_rate)
    finally:
        if stop is not None:
            stop()
        if llm is not None:
            llm.close()
    print(format_serving(r))
    if ns.output_json:
        bench.write_json(r, ns.output_json)
    return 0 if r["failed"] == 0 else 1
