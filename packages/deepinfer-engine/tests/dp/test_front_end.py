"""LLM(data_parallel_size=N, enable_expert_parallel=True) on tiny V4.1 and V4 checkpoints, gloo ranks on the CPU:
greedy output equals the single-process engine for a mixed batch and for fewer requests than ranks (idle ranks
run empty MoE steps), also with EPLB rebalancing redundant experts mid-run; pure DP (every rank holds all
experts); a rank that raises or is killed makes the call raise RankFailedError naming it, with no process
left; close / context manager / garbage collection leave no process behind."""

from __future__ import annotations

import gc
import os
import signal
import time

import pytest
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.dp import DPRankCore
from deepinfer_parallel import RankFailedError

pytestmark = pytest.mark.distributed

PROMPTS = [[0, 11, 12, 13], [0] + list(range(100, 113)), [0, 7], [0, 40, 41, 42, 43, 44, 45, 46], [0, 300, 301]]
ONE = [[0, 5, 6, 7, 8, 9]]  # fewer requests than ranks: the others stay idle
GREEDY = SamplingParams(temperature=0, max_tokens=5)
SEEDED = SamplingParams(temperature=1.0, top_k=50, max_tokens=4, seed=42, ignore_eos=True)
NUM_EXPERTS = 8  # the tiny presets


def _opts(arch: str) -> dict:
    return {"device": "cpu", "dtype": "float32", "page_size": 4 if arch == "v41" else 8}


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    """Token ids of the single-process engine: {arch: (PROMPTS greedy, ONE greedy, PROMPTS seeded sampling)}."""
    made: dict[str, tuple] = {}

    def get(arch: str):
        if arch not in made:
            llm = LLM(str(tiny_ckpt(arch)), **_opts(arch))
            made[arch] = tuple(_ids(llm.generate(p, sp, use_tqdm=False))
                               for p, sp in ((PROMPTS, GREEDY), (ONE, GREEDY), (PROMPTS, SEEDED)))
        return made[arch]

    return get


def _ids(outs) -> list[list[int]]:
    assert all(o.error is None for o in outs)
    return [o.outputs[0].token_ids for o in outs]


def _all_gone(pids: list[int], within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


EPLB = {"enable_eplb": True, "eplb_window_size": 2, "eplb_step_interval": 2}


@pytest.mark.parametrize(("arch", "world", "extra"), [
    ("v41", 2, {}),
    ("v41", 4, {**EPLB, "num_redundant_experts": 4}),
    ("v4", 2, {**EPLB, "num_redundant_experts": 2}),
    ("v4", 4, {}),
])  # fmt: skip
def test_expert_parallel_greedy_equals_single_process(tiny_ckpt, reference, arch, world, extra) -> None:
    want_batch, want_one, _ = reference(arch)
    slots = (NUM_EXPERTS + extra.get("num_redundant_experts", 0)) // world
    with LLM(str(tiny_ckpt(arch)), data_parallel_size=world, enable_expert_parallel=True, **_opts(arch), **extra) as llm:
        core = llm.engine.core
        pids = core.pids
        # every rank loaded only the experts of its slots (redundant slots included)
        assert [len(info.held_experts[0]) for info in core.infos] == [slots] * world
        assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want_batch
        stats = core.dp_stats()
        assert all(n >= 1 for n in stats["requests_per_rank"])  # load placement fills every rank first
        empty_before = list(stats["empty_steps_per_rank"])
        assert _ids(llm.generate(ONE, GREEDY, use_tqdm=False)) == want_one
        stats = core.dp_stats()
        busy = max(range(world), key=lambda r: stats["tokens_per_rank"][r])
        gained = [a - b for a, b in zip(stats["empty_steps_per_rank"], empty_before)]
        # the idle ranks ran one empty MoE step per step of the busy one (prefill + 4 decodes)
        assert gained[busy] == 0 and all(g >= 5 for r, g in enumerate(gained) if r != busy), gained
        if extra:
            assert stats["eplb_rearrangements"] >= 3  # the first after 1 step, then every 2
    assert _all_gone(pids)
    results = core.results
    assert results is not None and [r["steps"] for r in results] == [results[0]["steps"]] * world
    if extra:
        initial = [list(range(r * slots, (r + 1) * slots)) for r in range(world)]
        moved = [[[e for e in layer] for layer in r["held_experts"]] for r in results]
        assert any(layer != [e % NUM_EXPERTS for e in initial[r]] for r in range(world) for layer in moved[r])


def _interrupt_one_step(llm: LLM, monkeypatch) -> None:
    """A call interrupted (Ctrl-C) while its step runs on the ranks; the next call must collect that step first."""
    core = llm.engine.core
    gather, interrupts = core._gather_or_raise, []

    def interrupted(kind, timeout_s):
        if not interrupts:
            interrupts.append(kind)
            raise KeyboardInterrupt
        return gather(kind, timeout_s)

    monkeypatch.setattr(core, "_gather_or_raise", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    monkeypatch.undo()


def test_pure_data_parallel_holds_every_expert_and_is_reaped_when_dropped(tiny_ckpt, reference, monkeypatch) -> None:
    want_batch, _, want_seeded = reference("v41")
    llm = LLM(str(tiny_ckpt("v41")), data_parallel_size=2, **_opts("v41"))
    core = llm.engine.core
    assert [list(info.held_experts[0]) for info in core.infos] == [list(range(NUM_EXPERTS))] * 2
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want_batch
    # seeded sampling does not depend on the rank a request lands on
    assert _ids(llm.generate(PROMPTS, SEEDED, use_tqdm=False)) == want_seeded
    # an abort reaches the request's rank with the next step and comes back as its final output
    llm.engine.add_request("to-abort", PROMPTS[1], GREEDY)
    llm.engine.abort_request("to-abort")
    outs = llm.engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [("to-abort", "abort")]
    assert not llm.engine.has_unfinished_requests()
    _interrupt_one_step(llm, monkeypatch)
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == want_batch
    assert not llm.engine.has_unfinished_requests()
    pids = core.pids
    del llm, core
    gc.collect()
    assert _all_gone(pids)


def _fail_on_rank1(monkeypatch, action) -> None:
    """Make rank 1 fail in its second step. Ranks are forked from this process, so they inherit the patch."""
    original = DPRankCore.step_report

    def step_report(self):
        if self.state.rank == 1 and self.steps == 1:
            action()
        return original(self)

    monkeypatch.setattr(DPRankCore, "step_report", step_report)


def _raise() -> None:
    raise RuntimeError("injected fault in rank 1")


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize(("action", "needle"), [(_raise, "injected fault in rank 1"), (_kill_self, "signal 9")])
def test_a_failing_rank_fails_the_call_naming_it_and_leaves_no_process(tiny_ckpt, monkeypatch, action, needle) -> None:
    _fail_on_rank1(monkeypatch, action)
    llm = LLM(str(tiny_ckpt("v41")), data_parallel_size=2, enable_expert_parallel=True, **_opts("v41"))
    pids = llm.engine.core.pids
    t0 = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    assert info.value.rank == 1 and needle in str(info.value)
    assert _all_gone(pids)
    with pytest.raises(RankFailedError):  # the engine stays failed, it does not hang
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.close()


@pytest.mark.parametrize(("opts", "env", "needle"), [
    ({"data_parallel_size": 3, "enable_expert_parallel": True}, {}, "num_redundant_experts=1"),
    ({"data_parallel_size": 4, "enable_expert_parallel": True}, {"RANK": "0", "WORLD_SIZE": "2"}, "WORLD_SIZE=2"),
])  # fmt: skip
def test_layouts_that_cannot_run_are_refused_before_any_rank_starts(tiny_ckpt, monkeypatch, opts, env, needle) -> None:
    from deepinfer_engine.errors import ConfigError
    from deepinfer_parallel import SpawnedRanks

    for k, v in env.items():
        monkeypatch.setenv(k, v)

    def no_spawn(*a, **k):
        raise AssertionError("a rank was started")

    monkeypatch.setattr(SpawnedRanks, "__init__", no_spawn)
    with pytest.raises(ConfigError, match=needle):
        LLM(str(tiny_ckpt("v41")), **_opts("v41"), **opts)
