"""Engine options: kv_cache_dtype (docs/fidelity.md §5), the parallel section, the async_scheduling default."""

from __future__ import annotations

import argparse

import pytest
from deepinfer_engine import EngineConfig
from deepinfer_engine.config import add_engine_args
from deepinfer_engine.errors import ConfigError


def test_kv_cache_dtype_option() -> None:
    assert EngineConfig.from_options().cache.kv_cache_dtype == "bfloat16"
    assert EngineConfig.from_options(kv_cache_dtype="auto").cache.kv_cache_dtype == "auto"
    with pytest.raises(ConfigError, match="kv_cache_dtype: found 'fp8'"):
        EngineConfig.from_options(kv_cache_dtype="fp8")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    cfg = EngineConfig.from_cli(parser.parse_args(["--kv-cache-dtype", "auto"]))
    assert cfg.cache.kv_cache_dtype == "auto"


def test_parallel_section_defaults_validation_and_layout() -> None:
    cfg = EngineConfig.from_options()
    p = cfg.parallel
    assert (p.data_parallel_size, p.enable_expert_parallel, p.enable_eplb) == (1, False, False)
    assert (p.num_redundant_experts, p.eplb_window_size, p.eplb_step_interval) == (0, 1000, 3000)
    layout = EngineConfig.from_options(
        data_parallel_size=4, enable_expert_parallel=True, enable_eplb=True, num_redundant_experts=8
    ).parallel.to_parallel()
    assert (layout.dp_size, layout.ep_size, layout.num_redundant_experts, layout.enable_eplb) == (4, 4, 8, True)
    assert EngineConfig.from_options(data_parallel_size=2).parallel.to_parallel().ep_size == 1
    for opts, needle in [
        ({"data_parallel_size": 0}, "data_parallel_size: found 0"),
        ({"num_redundant_experts": -1}, "num_redundant_experts: found -1"),
        ({"eplb_window_size": 5000}, "eplb_window_size: found 5000"),
        ({"enable_eplb": True}, "enable_expert_parallel"),
        ({"data_parallel_size": "2"}, "data_parallel_size"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            EngineConfig.from_options(**opts)


def test_speculative_section_defaults_and_validation() -> None:
    s = EngineConfig.from_options().speculative
    assert (s.speculative_method, s.num_speculative_tokens, s.speculative_policy) == (None, None, "verify_all")
    assert s.speculative_threshold == 0.5
    s = EngineConfig.from_options(speculative_method="dspark", speculative_policy="threshold",
                                  speculative_threshold=0.8, num_speculative_tokens=4).speculative
    assert (s.speculative_method, s.speculative_policy, s.speculative_threshold, s.num_speculative_tokens) == (
        "dspark", "threshold", 0.8, 4)
    for opts, needle in [
        ({"speculative_method": "eagle"}, "speculative_method: found 'eagle'"),
        ({"speculative_policy": "greedy"}, "speculative_policy: found 'greedy'"),
        ({"speculative_threshold": 1.5}, "speculative_threshold: found 1.5"),
        ({"speculative_method": "dspark", "num_speculative_tokens": 0}, "num_speculative_tokens: found 0"),
        ({"num_speculative_tokens": 3}, "without a speculative_method"),
        ({"speculative_method": "dspark", "speculative_latency": "affine:0.1"}, "speculative_latency: found"),
        ({"speculative_method": "dspark", "speculative_latency": "affine:-1,0.1"}, "speculative_latency: found"),
        ({"speculative_method": "dspark", "speculative_calibration": "isotonic"}, "speculative_calibration: found"),
    ]:
        with pytest.raises(ConfigError, match=needle):
            EngineConfig.from_options(**opts)


def test_new_options_round_trip_and_appear_as_cli_flags() -> None:
    opts = dict(data_parallel_size=2, enable_expert_parallel=True, enable_eplb=True, num_redundant_experts=2,
                eplb_window_size=10, eplb_step_interval=20, speculative_method="mtp", num_speculative_tokens=1,
                speculative_policy="cost", speculative_threshold=0.25)
    cfg = EngineConfig.from_options(**opts)
    back = cfg.to_options()
    assert {k: back[k] for k in opts} == opts
    assert EngineConfig.from_options(**back) == cfg
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    help_text = parser.format_help()
    for name in opts:
        assert "--" + name.replace("_", "-") in help_text
    argv = ["--data-parallel-size", "2", "--enable-expert-parallel", "--speculative-method", "dspark",
            "--speculative-policy", "threshold", "--speculative-threshold", "0.7"]
    cli = EngineConfig.from_cli(parser.parse_args(argv))
    assert (cli.parallel.data_parallel_size, cli.parallel.enable_expert_parallel) == (2, True)
    assert (cli.speculative.speculative_method, cli.speculative.speculative_threshold) == ("dspark", 0.7)


def test_generate_help_lists_the_options(capsys) -> None:
    from deepinfer_engine.cli import main

    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for flag in ("--data-parallel-size", "--enable-expert-parallel", "--enable-eplb", "--num-redundant-experts",
                 "--eplb-window-size", "--eplb-step-interval", "--speculative-method", "--num-speculative-tokens",
                 "--speculative-policy", "--speculative-threshold"):
        assert flag in out


def test_vllm_speculative_config_dict(monkeypatch) -> None:
    from deepinfer_engine import llm as llm_module
    from deepinfer_engine.config import speculative_options

    assert speculative_options(None) == {}
    assert speculative_options({"method": "dspark", "num_speculative_tokens": 3}) == {
        "speculative_method": "dspark", "num_speculative_tokens": 3}
    with pytest.raises(ConfigError, match="speculative_config: found key"):
        speculative_options({"method": "dspark", "model": "some/draft"})
    seen = {}

    def capture(config):
        seen["config"] = config
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(llm_module.LLMEngine, "from_config", staticmethod(capture))
    with pytest.raises(RuntimeError, match="stop before loading"):
        llm_module.LLM(speculative_config={"method": "mtp", "num_speculative_tokens": 1, "policy": "cost"})
    s = seen["config"].speculative
    assert (s.speculative_method, s.num_speculative_tokens, s.speculative_policy) == ("mtp", 1, "cost")


@pytest.mark.parametrize(("opts", "needle", "why"), [
    # data parallelism runs through LLM / LLMEngine (deepinfer_engine.dp), whose ranks are EngineCores
    ({"data_parallel_size": 2}, "data_parallel_size: found 2", "one EngineCore runs one rank"),
    ({"speculative_method": "dspark", "prefill_truncation": "compact"}, "prefill_truncation: found 'compact'",
     "speculative decoding reads the draft context from every prefill row"),
    ({"speculative_method": "dspark", "data_parallel_size": 2}, "speculative_method: found 'dspark'",
     "the data-parallel ranks do not speculate yet"),
])
def test_engine_loop_refuses_what_it_does_not_run(opts, needle, why, monkeypatch) -> None:
    from deepinfer_engine.engine import EngineCore

    def no_default_model(*a, **k):
        raise AssertionError("the refusal must come before any loading")

    monkeypatch.setattr("deepinfer_engine.default_model.default_model_dir", no_default_model)
    with pytest.raises(ConfigError, match=needle) as info:
        EngineCore.from_config(EngineConfig.from_options(**opts))
    assert why in str(info.value)


def test_prefix_cache_options_defaults_flags_and_errors() -> None:
    c = EngineConfig.from_options().cache
    assert (c.enable_prefix_caching, c.prefix_replay, c.prefix_cache_host_bytes, c.num_prefix_state_slots) == (
        True, "exact", 0, None)
    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--no-enable-prefix-caching", "--prefix-replay", "approximate", "--prefix-cache-host-bytes",
                       "2GiB"])
    c = EngineConfig.from_cli(ns).cache
    assert (c.enable_prefix_caching, c.prefix_replay, c.prefix_cache_host_bytes) == (False, "approximate", 2**31)
    with pytest.raises(ConfigError, match="prefix_replay: found 'fuzzy'"):
        EngineConfig.from_options(prefix_replay="fuzzy")
    with pytest.raises(ConfigError, match="prefix_cache_host_bytes"):
        EngineConfig.from_options(prefix_cache_host_bytes=-1)
    with pytest.raises(ConfigError, match="num_prefix_state_slots"):
        EngineConfig.from_options(num_prefix_state_slots=-2)


def test_async_scheduling_default_is_on_for_cuda_only_where_it_runs() -> None:
    import torch
    from deepinfer_engine.engine import resolve_async_scheduling

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    unset = EngineConfig.from_options()
    assert unset.scheduler.async_scheduling is None
    assert resolve_async_scheduling(unset, cuda).scheduler.async_scheduling is True
    assert resolve_async_scheduling(unset, cpu).scheduler.async_scheduling is False
    spec = EngineConfig.from_options(speculative_method="dspark")
    assert resolve_async_scheduling(spec, cuda).scheduler.async_scheduling is False
    dp = EngineConfig.from_options(data_parallel_size=2)
    assert resolve_async_scheduling(dp, cuda).scheduler.async_scheduling is False
    for explicit in (True, False):  # an explicit choice is kept, on either device
        cfg = EngineConfig.from_options(async_scheduling=explicit)
        assert resolve_async_scheduling(cfg, cpu).scheduler.async_scheduling is explicit
        assert resolve_async_scheduling(cfg, cuda).scheduler.async_scheduling is explicit
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig.from_cli(parser.parse_args([])).scheduler.async_scheduling is None
    assert EngineConfig.from_cli(parser.parse_args(["--no-async-scheduling"])).scheduler.async_scheduling is False


def test_llm_config_reports_the_resolved_async_scheduling(tiny_ckpt) -> None:
    from deepinfer_engine import LLM

    llm = LLM(str(tiny_ckpt("v41")), device="cpu", dtype="float32", page_size=4, max_model_len=24)
    assert llm.config.scheduler.async_scheduling is False  # CPU: nothing to overlap
    assert llm.engine.config.scheduler.async_scheduling is False


def test_expert_layout_option_resolves_per_device() -> None:
    import torch
    from deepinfer_engine.engine import AUTO_EXPERT_LAYOUT_CUDA, resolve_expert_layout

    assert EngineConfig.from_options(expert_layout="chunked").model.expert_layout == "chunked"
    with pytest.raises(ConfigError, match="expert_layout"):
        EngineConfig.from_options(expert_layout="tiled")
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # the chunked layout is read by the GPU kernels only: the CPU keeps the checkpoint bytes whatever was asked
    assert [resolve_expert_layout(o, cpu) for o in ("auto", "checkpoint", "chunked")] == ["checkpoint"] * 3
    assert resolve_expert_layout("auto", cuda) == AUTO_EXPERT_LAYOUT_CUDA
    assert resolve_expert_layout("checkpoint", cuda) == "checkpoint"
    assert resolve_expert_layout("chunked", cuda) == "chunked"


def test_pdl_option_default_validation_and_flags() -> None:
    """`pdl` (programmatic dependent launch, docs/pdl.md): on by default (a launch-order hint, same results), off
    with pdl=False or --no-pdl; the engine hands it to the model once (Transformer.set_pdl)."""
    assert EngineConfig.from_options().model.pdl is True
    cfg = EngineConfig.from_options(pdl=False)
    assert cfg.model.pdl is False and cfg.to_options()["pdl"] is False
    assert EngineConfig.from_options(**cfg.to_options()) == cfg
    assert cfg.replace(pdl=True).model.pdl is True
    for bad in ("no", 0, None):
        with pytest.raises(ConfigError, match="pdl: found"):
            EngineConfig.from_options(pdl=bad)
    from deepinfer_engine.config import ModelConfig

    with pytest.raises(ConfigError, match="pdl: found 'off', expected True or False"):
        ModelConfig(pdl="off")  # built directly, without the option table's type check
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert EngineConfig.from_cli(parser.parse_args([])).model.pdl is True  # no flag: the dataclass default
    assert EngineConfig.from_cli(parser.parse_args(["--no-pdl"])).model.pdl is False
    assert EngineConfig.from_cli(parser.parse_args(["--pdl"])).model.pdl is True


def test_bench_latency_takes_no_pdl() -> None:
    from deepinfer_engine.cli import build_parser

    ns = build_parser().parse_args(["bench", "latency", "--no-pdl", "--batch-size", "1,64"])
    assert EngineConfig.from_cli(ns).model.pdl is False and ns.batch_size == [1, 64]


def test_side_streams_option_default_validation_and_flags() -> None:
    """`side_streams` (docs/overlap.md): on by default (same results), off with side_streams=False or
    --no-side-streams (also on `bench latency`); the engine hands it to the model once (Transformer.set_overlap)."""
    from deepinfer_engine.cli import build_parser

    assert EngineConfig.from_options().model.side_streams is True
    cfg = EngineConfig.from_options(side_streams=False)
    assert cfg.model.side_streams is False and EngineConfig.from_options(**cfg.to_options()) == cfg
    with pytest.raises(ConfigError, match="side_streams: found"):
        EngineConfig.from_options(side_streams="no")
    ns = build_parser().parse_args(["bench", "latency", "--no-side-streams", "--batch-size", "1"])
    assert EngineConfig.from_cli(ns).model.side_streams is False
