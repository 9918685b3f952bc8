"""Speculative steps through the fixed-shape (graph) path of the engine, on CPU: the runner's verify hook
(`CudaGraphRunner.verify_shape_of` / `run_verify`) with the capture replaced by the same StaticDecodeStep forward
run eagerly on every "replay", so that the ragged (B, L, T) shapes, the real rows read from the graph's outputs,
the captured features / final streams handed to the drafters and the padding sequence are exercised without a GPU.
The DSpark draft pass and draft-ring writes take the same path (`run_draft`, `run_insert`). Greedy speculation
through it equals plain greedy decoding token for token (DSpark on V4.1 and V4-0731, MTP on V4, every verification
policy on V4.1: mixed verify lengths per step), and verify steps, draft passes and draft-ring writes really took
that path (the rings equal the eager engine's).
The bucket rules of verify steps are checked on their own."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest
import torch
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.worker.cuda_graph import (
    graph_batch_sizes,
    verify_row_sizes,
    verify_shape,
    verify_token_sizes,
)
from eager_graphs import EagerReplayGraphs

PROMPTS = [[0, 5, 6, 7], [0, 9], list(range(3, 20)), [0, 11, 12, 13, 14, 15, 16, 17, 18]]  # mixed lengths


@pytest.fixture(scope="module")
def ckpts(tiny_ckpt) -> dict[str, Path]:
    return {"v41": tiny_ckpt("v41"), "v4-0731": tiny_ckpt("v4", "tiny-dspark"), "v4": tiny_ckpt("v4")}


def _llm(path: Path, **kw) -> LLM:
    page = 4 if path.name == "v41" else 8  # a multiple of every compress ratio
    return LLM(str(path), device="cpu", dtype="float32", page_size=page, max_num_seqs=4, **kw)


def _ids(outs) -> list[list[int]]:
    return [list(c.token_ids) for o in outs for c in o.outputs]


def _with_static_graphs(llm: LLM) -> EagerReplayGraphs:
    eng = llm.engine
    graphs = EagerReplayGraphs(eng.runner.model, eng.runner.cache, max_num_seqs=4, max_model_len=eng.max_model_len)
    eng.runner.cuda_graphs = graphs
    drafter = eng.runner.spec.drafter  # the draft pass too: DSpark's stages, or V4's MTP block
    drafter.block_runner = graphs.run_mtp if hasattr(drafter, "after_step") else graphs.run_draft
    if not hasattr(drafter, "after_step"):  # and DSpark's fused draft round and draft-ring writes
        drafter.proposal_runner = graphs.run_draft_proposal
        eng.runner.spec.insert_runner = graphs.run_insert
    eng.runner.spec.graph_rows = {b: verify_row_sizes(b, eng.runner.spec.max_drafts + 1) for b in graphs.batch_sizes}
    return graphs


@pytest.mark.parametrize(("name", "method", "policies"), [
    ("v41", "dspark", ("verify_all", "threshold", "cost")),
    ("v4-0731", "dspark", ("verify_all",)),
    ("v4", "mtp", ("verify_all",)),
])
def test_greedy_speculation_through_static_steps_equals_plain_greedy(ckpts, name, method, policies) -> None:
    from deepinfer_dspark import LatencyModel, VerifyPolicy

    sp = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    prompts = PROMPTS if name == "v41" else PROMPTS[:3]
    plain = _ids(_llm(ckpts[name]).generate(prompts, sp, use_tqdm=False))
    eager = _llm(ckpts[name], speculative_config={"method": method}, enable_prefix_caching=False)
    assert _ids(eager.generate(prompts, sp, use_tqdm=False)) == plain
    llm = _llm(ckpts[name], speculative_config={"method": method}, enable_prefix_caching=False)
    graphs = _with_static_graphs(llm)
    spec = llm.engine.runner.spec
    for policy in policies:
        spec.policy = VerifyPolicy(kind=policy)
        spec.latency = LatencyModel.affine(0.01, 0.001, 64) if policy == "cost" else spec.latency
        spec.online_latency = False
        spec.reset_stats()
        before = graphs.stats.verify_replays
        assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == plain, (name, policy)
        assert graphs.stats.verify_replays > before, (name, policy)
        if policy == "verify_all":  # the same drafts as the eager draft pass: the same acceptance
            want = eager.engine.runner.spec.stats
            got = spec.stats
            assert (got.num_verified_tokens, got.num_accepted_tokens) == (
                want.num_verified_tokens, want.num_accepted_tokens), name
        if policy == "verify_all" and method == "dspark":  # ... and the same draft rings, every request slot
            mine, ref = llm.engine.runner.cache, eager.engine.runner.cache
            for st in llm.engine.runner.model.mtp:
                lid = st.attn.layer_id
                torch.testing.assert_close(mine.swa[lid][: mine.num_slots], ref.swa[lid][: ref.num_slots],
                                           rtol=1e-4, atol=1e-4)
        if method == "mtp":  # the drafts the block left for each request's next step: equal to the eager pass's
            mine, ref = spec.drafter._pending, eager.engine.runner.spec.drafter._pending
            assert mine.keys() == ref.keys() and mine
            for slot, (pos, logits) in ref.items():
                assert mine[slot][0] == pos
                torch.testing.assert_close(mine[slot][1], logits, rtol=1e-4, atol=1e-4)
    st = graphs.stats
    assert st.verify_captures == len(set(st.verify_shapes)) and st.verify_eager_steps > 0  # prefill steps: eager
    # ragged steps of up to k + 1 rows per sequence, at least one with more rows than sequences
    assert {g.step.tokens for k, g in graphs.graphs.items() if len(k) == 3 and k in st.verify_shapes} == {
        spec.max_drafts + 1} and spec.max_drafts + 1 >= 2
    assert any(t > b for b, _, t in st.verify_shapes), st.verify_shapes
    assert spec.stats.request_steps > 0 and st.replays == 0  # every decode step of a speculative engine verifies
    if method == "dspark":
        assert st.draft_replays > 0 and st.draft_eager_steps == 0, st  # every draft pass replayed
        assert {s[1] for s in st.draft_shapes} == {spec.block_size}, st.draft_shapes  # (B, N[, heads version])
        # the draft-ring writes of every step keeping at most k + 1 rows per sequence; prefill steps: eager
        assert st.insert_replays >= st.verify_replays > 0 and st.insert_eager_steps > 0, st
        assert {q for _, q in st.insert_shapes} == {spec.max_drafts + 1}, st.insert_shapes
    else:  # steps with a prefill chunk run the MTP block eagerly (more than 2 rows per sequence)
        assert st.mtp_replays > 0 and {q for _, q in st.mtp_shapes} <= {1, 2}, st


def test_uncaptured_row_buckets_replay_a_wider_graph_until_asked_for_often(ckpts) -> None:
    """A verify step whose row bucket has no graph yet replays the captured larger bucket of its (B, L) with padding
    rows, the same tokens as plain decoding, until the bucket has been asked for `verify_capture_after` times; only
    then is it captured (a capture stalls a step for about a second on the GPU)."""
    from deepinfer_dspark import VerifyPolicy

    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    plain = _ids(_llm(ckpts["v41"]).generate(PROMPTS, sp, use_tqdm=False))
    llm = _llm(ckpts["v41"], speculative_config={"method": "dspark"}, enable_prefix_caching=False)
    graphs = _with_static_graphs(llm)
    spec = llm.engine.runner.spec
    assert _ids(llm.generate(PROMPTS, sp, use_tqdm=False)) == plain  # verify_all: the largest bucket of each (B, L)
    st = graphs.stats
    full = set(st.verify_shapes)
    # (the last steps, near max_tokens, verify fewer drafts: they already ran on the full bucket)
    assert all(t == b * (spec.max_drafts + 1) for b, _, t in full), full
    padded = st.verify_padded
    # a threshold of 1 (the random heads never reach it): every step verifies no draft and asks for the smallest
    # bucket; while a wider graph of its (B, L) exists, nothing is captured
    graphs.verify_capture_after = 10**9
    spec.set_policy(VerifyPolicy(kind="threshold", threshold=1.0))
    replays = st.verify_replays
    assert _ids(llm.generate(PROMPTS, sp, use_tqdm=False)) == plain
    assert set(st.verify_shapes) == full and st.verify_captures == len(full)
    assert st.verify_padded - padded == st.verify_replays - replays > 0
    # asked for often enough, a bucket gets its own graph
    graphs.verify_capture_after = 2
    assert _ids(llm.generate(PROMPTS, sp, use_tqdm=False)) == plain
    new = set(st.verify_shapes) - full
    assert new and all(t < b * (spec.max_drafts + 1) for b, _, t in new), new


def test_fused_draft_round_equals_the_pass_then_eager_sampling(ckpts) -> None:
    """`StageDrafter.propose_block` through the runner's fused draft round (here the eager stand-in, which holds
    the captured callable weakly as a CUDA graph does) == the draft pass followed by the eager `sample_block` for
    greedy, mixed and all-sampled rounds of 3 requests (bucket 4: one padding block), with a greedy head and
    per-position STS sets: the same drafts, and confidences and probabilities within float32 rounding (the fused
    round's matmuls have the bucket's 4 rows, CPU BLAS blocks them differently). The constants the round reads
    (its STS divisors) must live as long as its graph. The GPU twin (bit for bit) is in test_spec_graphs_cuda.py."""
    from deepinfer_dspark import propose

    llm = _llm(ckpts["v41"], speculative_config={"method": "dspark"}, enable_prefix_caching=False)
    graphs = _with_static_graphs(llm)
    llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    drafter = llm.engine.runner.spec.drafter
    g = torch.Generator().manual_seed(0)
    width = drafter.heads.confidence.numel()
    drafter.set_heads(sts=(1.0, 0.5, 2.0, 0.8, 1.3)[: drafter.block_size], greedy_sts=0.7,
                      greedy_confidence=torch.randn(1, width, generator=g))
    slots, anchors, positions = [2, 0, 1], [17, 300, 5], [9, 40, 23]
    drafter.slots = torch.tensor(slots)
    drafter.round_host = (slots, anchors, positions)
    a, p = torch.tensor(anchors), torch.tensor(positions)
    seeds = torch.tensor([3, -7, 1 << 40])
    fused = drafter.proposal_runner
    # grad mode on, as a direct caller may leave it: the captures must not depend on it (a sampled round's graph
    # failed to capture on the GPU when its probability buffer was written by an out= op under autograd)
    for temp in ([0.0, 0.0, 0.0], [0.0, 0.9, 0.0], [0.7, 1.0, 1.6]):
        kw = {"temperature": torch.tensor(temp), "seeds": seeds if any(x > 0 for x in temp) else None}
        drafter.proposal_runner = fused
        propose(drafter, a, p, **kw)  # captures this round's graph
        gc.collect()  # what only the capture's closure held is gone now, unless the graph's record keeps it
        before = graphs.stats.draft_replays
        got = propose(drafter, a, p, **kw)
        drafter.proposal_runner = None
        want = propose(drafter, a, p, **kw)
        assert graphs.stats.draft_replays == before + 2  # fused, then the pass alone
        assert torch.equal(got.draft_ids, want.draft_ids), temp
        torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-6, atol=1e-7)
        assert (got.draft_probs is None) == (want.draft_probs is None), temp
        if got.draft_probs is not None:
            torch.testing.assert_close(got.draft_probs, want.draft_probs, rtol=1e-6, atol=1e-9)
            # a sampled round's graph writes the runner's one probability buffer (all batch buckets share it)
            assert got.draft_probs.data_ptr() == graphs._outputs["draft.probs"].data_ptr()
    drafter.proposal_runner = fused
    assert not graphs.failed


def test_verify_buckets():
    assert verify_token_sizes(1) == (1,)
    assert verify_token_sizes(2) == (1, 2)
    assert verify_token_sizes(6) == (1, 2, 4, 6)
    assert verify_row_sizes(1, 6) == (1, 2, 3, 4, 5, 6)
    assert verify_row_sizes(4, 3) == (4, 6, 8, 10, 12)
    assert verify_row_sizes(5, 2) == (5, 8, 10)  # half batches rounded up
    sizes, toks = graph_batch_sizes(8), 6
    # verify chunks of 1 + m rows beside one-token decode chunks: rows back to back, rounded up to a row bucket of
    # the batch bucket; L covers each sequence's real rows
    assert verify_shape((3, 1, 6), (5, 300, 7), list(range(10)), sizes, toks, 4096) == (4, 512, 10)
    assert verify_shape((3, 1, 1), (5, 9, 7), list(range(5)), sizes, toks, 4096) == (4, 256, 6)
    assert verify_shape((2, 1), (254, 9), [0, 1, 2], sizes, toks, 4096) == (2, 256, 3)
    assert verify_shape((2, 1), (255, 9), [0, 1, 2], sizes, toks, 4096) == (2, 512, 3)
    assert verify_shape((1, 1), (5, 9), [0, 1], sizes, toks, 4096) == (2, 256, 2)
    assert verify_shape((7, 1), (5, 9), list(range(8)), sizes, toks, 4096) is None  # more rows than k + 1
    assert verify_shape((3, 4), (5, 9), [2, 3, 4, 5, 6], sizes, toks, 4096) is None  # a prefill chunk: last row
    assert verify_shape((2, 1), (5, 9), [0, 0, 1, 2], sizes, toks, 4096) is None  # prompt logprobs
    assert verify_shape((1,) * 9, (3,) * 9, list(range(9)), sizes, toks, 4096) is None  # past the largest bucket
    assert verify_shape((2,), (4095,), [0, 1], sizes, toks, 4096) is None  # past max_model_len
    assert verify_shape((2,), (4094,), [0, 1], sizes, toks, 4096) == (1, 4096, 2)
    assert verify_shape((), (), [], sizes, toks, 4096) is None


def test_cost_profile_times_the_graphed_verify_step() -> None:
    """The cost policy's start-up profile runs verify-shaped steps through the verify graphs when the engine has
    them (here the eager stand-in), and their outputs are the eager forward's (tiny V4.1, random weights)."""
    from deepinfer_engine.model.args import ModelArgs
    from deepinfer_engine.model.cache import ModelCache
    from deepinfer_engine.model.engram_hash import synthetic_token_map
    from deepinfer_engine.model.model import Transformer
    from deepinfer_engine.model.presets import tiny_v41_config
    from deepinfer_engine.worker.spec_profile import profile_target_latency, profiled_forward
    from equality import init_random_

    args = ModelArgs.from_config_dict(tiny_v41_config())
    model = init_random_(Transformer(args, torch.float32), seed=0).eval()
    model.set_engram_token_map(synthetic_token_map(args.vocab_size, args.engram_compressed_vocab_size))
    cache = ModelCache.allocate(args, num_slots=4, num_pages=16, page_size=4, dtype=torch.float32)
    graphs = EagerReplayGraphs(model, cache, max_num_seqs=4, max_model_len=256)
    capture, block = tuple(args.dspark_target_layer_ids), int(args.dspark_block_size)
    forward = profiled_forward(model, cache, graphs, capture, block + 1)
    seen = []

    def timed(batch):
        out = forward(batch)
        ref = model.forward_features(batch, cache, capture=capture)
        torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
        for lid in capture:
            torch.testing.assert_close(out.features[lid], ref.features[lid], rtol=1e-5, atol=1e-5)
        seen.append(batch.num_tokens)
        return out

    lat = profile_target_latency(timed, block_size=block, max_tokens=8, num_slots=cache.num_slots,
                                 pages=cache.num_pages, page_size=cache.page_size, device=torch.device("cpu"),
                                 repeats=1)
    assert list(lat.sizes) == [1, 2, 4, 8] and set(seen) == {1, 2, 4, 8}
    # each power of two is a row bucket of its batch bucket: the graphs ran it without padding rows
    assert graphs.stats.verify_replays == len(seen) and set(graphs.stats.verify_shapes) == {
        (1, 256, 1), (1, 256, 2), (1, 256, 4), (2, 256, 8)}
    # every verify graph wrote the leading rows of one buffer per output, sized for the largest row bucket (B = 4
    # sequences of k + 1 rows): the outputs cost the memory of one graph, not of every shape captured
    out, most = graphs._outputs, 4 * (block + 1)
    assert out["verify.logits"].shape == (most, args.vocab_size) and out["verify.hidden"].shape[0] == most
    for key, g in graphs.graphs.items():
        assert g.logits.data_ptr() == out["verify.logits"].data_ptr() and g.logits.shape[0] == key[2]
        assert g.hidden.data_ptr() == out["verify.hidden"].data_ptr()
        assert g.features.keys() == set(capture)
        assert all(f.data_ptr() == out[f"verify.features.{lid}"].data_ptr() for lid, f in g.features.items())


def test_cost_policy_prices_ragged_steps_and_learns_at_their_rows(ckpts, monkeypatch) -> None:
    """Through the graph path the cost policy prices a step by its row bucket: each step verifies the
    highest-survival drafts of any requests, as many as fill the bucket of the rows it chose (or all of them), the
    latency model is corrected at the rows the graph ran, and the whole round's non-forward time becomes its
    overhead."""
    from deepinfer_dspark import LatencyModel, VerifyPolicy
    from deepinfer_engine.worker import spec_decode

    sp = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    # three sequences run in the batch-4 graphs, so every graphed verify step has padding rows whatever the policy
    # picks (with four, a cap whose tokens fill a bucket would pad nothing, and whether that happens depends on the
    # online latency correction, i.e. on timing)
    prompts = PROMPTS[:3]
    plain = _ids(_llm(ckpts["v41"]).generate(prompts, sp, use_tqdm=False))
    llm = _llm(ckpts["v41"], speculative_config={"method": "dspark"}, enable_prefix_caching=False)
    assert len(prompts) not in _with_static_graphs(llm).batch_sizes
    spec = llm.engine.runner.spec
    calls, rows = [], []
    real = spec_decode.schedule_verification

    def spy(policy, max_drafts, **kw):
        got = real(policy, max_drafts, **kw)
        calls.append((list(max_drafts), kw["padding"], got.tolist(), kw["base_tokens"]))
        return got

    monkeypatch.setattr(spec_decode, "schedule_verification", spy)
    launch = spec.launch_verify
    monkeypatch.setattr(spec, "launch_verify", lambda rnd, out, n, r=None: rows.append((n, r)) or launch(rnd, out, n, r))
    # a steep curve prunes; the ragged pricing then fills the bucket of the rows it keeps
    spec.set_policy(VerifyPolicy(kind="cost"), LatencyModel.affine(0.001, 0.004, 64), online_latency=True)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == plain
    ragged = [(m, pad, got, base) for m, pad, got, base in calls if pad is not None]
    assert ragged and all(pad.ragged for _, pad, _, _ in ragged)
    assert any(sum(got) < sum(m) for m, _, got, _ in ragged)
    for m, pad, got, base in ragged:
        n = base + len(m) + sum(got)
        assert all(0 <= k <= mk for k, mk in zip(got, m)) and (sum(got) == sum(m) or pad.rows(n) == n), (m, got)
    assert all(r >= n for n, r in rows) and any(r == n for n, r in rows)  # the rows the graph ran
    assert 0 < spec.latency.observations <= len(rows)
    # the overhead is the rounds' whole non-forward time (draft pass, bookkeeping, scheduling), set by the first
    # observation: not an EMA of the draft pass alone growing from 0 (about 0.2 of it after the 4-5 rounds here)
    t = spec.timing
    assert spec.latency.overhead > 0.5 * t.draft_s / t.rounds > 0
    # a round during which a graph was captured is not timed into the curve (a capture takes seconds): with a
    # capture clock that moves every round, nothing is observed
    import itertools

    spec.capture_clock = itertools.count().__next__
    spec.set_policy(VerifyPolicy(kind="cost"), LatencyModel.affine(0.001, 0.004, 64), online_latency=True)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == plain
    assert spec.latency.observations == 0 and spec.latency.overhead_observations == 0
    # with a curve for the batch bucket the steps run in (4), that curve prices and learns every graphed round;
    # T(Q) is left to the steps no batch curve covers
    spec.capture_clock = None
    bucket = LatencyModel.affine(0.001, 0.004, 64)
    spec.set_policy(VerifyPolicy(kind="cost"), LatencyModel.affine(0.001, 0.0, 64), online_latency=True,
                    batch_latency={4: bucket})
    calls.clear()
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == plain
    assert any(sum(got) < sum(m) for m, pad, got, _ in calls if pad is not None)  # the steep bucket curve prunes
    assert bucket.observations > 0 and spec.latency.observations == 0
    assert bucket.overhead_observations > 0 and spec.latency.overhead_observations == 0


def test_the_decision_on_the_device_is_the_hosts(ckpts) -> None:
    """While the device drafts (here: `device_busy` reports so), `begin` enqueues the policy's decision behind the
    draft pass and reads the counts with the drafts: threshold, the cost policy's carried cutoff on greedy
    rounds (the global argmax over ragged row buckets, priced through the greedy calibration, on a round without
    one) and its carried budget on sampled rounds. It
    verifies what the host decides, draft for draft: the same tokens and statistics with it off, with requests
    nearing max_tokens, leaving the batch, and cut to fewer drafts by the token budget."""
    from deepinfer_dspark import SurvivalCalibration

    greedy = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 12, 12, 7)]
    sampled = [SamplingParams(temperature=0.8, max_tokens=n, ignore_eos=True, seed=s) for n, s in ((12, 1), (12, 2),
                                                                                                   (12, 3), (7, 4))]
    # greedy drafts priced far below their survivals: a decision that ignored the calibration would verify others
    calibration = SurvivalCalibration()
    grid = np.linspace(0.0, 1.0, 40)[None, :]
    for _ in range(30):
        calibration.update(grid, np.asarray([40]), np.asarray([0]), np.asarray([True]))
    for budget in (None, 20):  # 20 tokens: three requests of 1 + 5, the fourth gets 1 + 1
        llm = _llm(ckpts["v41"], speculative_config={"method": "dspark"}, enable_prefix_caching=False,
                   **({} if budget is None else {"max_num_batched_tokens": budget}))
        _with_static_graphs(llm)
        spec = llm.engine.runner.spec
        spec.draft_ahead = True
        spec.device_busy = lambda: True
        _decisions_match_the_host(llm, spec, calibration, greedy, sampled)
        del llm, spec
        gc.collect()


def _decisions_match_the_host(llm, spec, calibration, greedy, sampled) -> None:
    import copy

    from deepinfer_dspark import LatencyModel, VerifyPolicy

    for policy in (VerifyPolicy(kind="threshold", threshold=0.3), VerifyPolicy(kind="cost", lagged=True)):
        for sps in (greedy, sampled):
            runs = {}
            for decide in (False, True):
                # a steep fixed curve: the cost policy prunes, and both runs price every round alike
                spec.set_policy(policy, LatencyModel.affine(0.001, 0.002, 64), online_latency=False)
                spec.calibration = copy.deepcopy(calibration)
                spec.decide_on_device = decide
                spec.reset_stats()
                outs = llm.generate(PROMPTS, sps, use_tqdm=False)
                stats = spec.stats.as_dict()
                stats.pop("survival_reliability")  # survival bins: a float rounding may cross an edge
                runs[decide] = (_ids(outs), stats, spec.timing.decided, spec.timing.rounds)
            # counts exactly; survival sums up to float rounding (two runs of one engine differ by ~1e-7 there)
            got, want = runs[True][1], runs[False][1]
            assert runs[True][0] == runs[False][0] and got.keys() == want.keys(), (policy, sps[0].temperature)
            assert all(got[k] == (pytest.approx(v, rel=1e-5) if v is not None else None) for k, v in want.items()), \
                (policy, sps[0].temperature, got, want)
            assert got["num_verified_tokens"] < got["num_draft_tokens"]  # the policy pruned
            decided, rounds = runs[True][2:]
            # every round but a sampled cost round without a carried budget (the first, and after a shape change)
            assert runs[False][2] == 0 and (decided == rounds if sps is greedy or policy.kind == "threshold"
                                            else 0 < decided < rounds), (policy, sps[0].temperature, decided, rounds)


def test_build_spec_decoder_wires_the_graphs(ckpts, monkeypatch) -> None:
    """With a graph runner, the engine's speculative decoder replays the draft passes and draft-ring writes through
    it, prices verify steps by the ragged row buckets of each batch bucket, with a curve per batch bucket timed on
    that bucket's own graphs, and reads the runner's capture clock."""
    from deepinfer_engine.worker import spec_profile
    from deepinfer_engine.worker.spec_build import build_spec_decoder

    llm = _llm(ckpts["v41"], speculative_config={"method": "dspark", "policy": "cost"}, enable_prefix_caching=False)
    eng = llm.engine
    graphs = EagerReplayGraphs(eng.runner.model, eng.runner.cache, max_num_seqs=4, max_model_len=eng.max_model_len)
    monkeypatch.setattr(spec_profile, "BATCH_PROFILE_MIN", 2)  # the tiny engine's buckets: 1, 2, 4
    dec, k = build_spec_decoder(eng.config, eng.runner.model, eng.runner.cache, model_dir=eng.model_dir,
                                num_pages=eng.plan.num_pages, device=torch.device("cpu"), graphs=graphs)
    assert dec.graph_rows == {b: verify_row_sizes(b, k + 1) for b in graphs.batch_sizes} and k >= 1
    assert dec.drafter.block_runner == graphs.run_draft and dec.insert_runner == graphs.run_insert
    assert graphs.stats.verify_replays > 0  # the start-up profile timed graph-replayed verify steps
    assert dec.batch_latency.keys() == {2, 4} and dec.latency is not None
    for b, curve in dec.batch_latency.items():  # every row bucket of b, each run as b sequences in b's own graph
        assert curve.sizes == list(verify_row_sizes(b, k + 1))
        assert {(b, r) for r in curve.sizes} <= {(s[0], s[2]) for s in graphs.stats.verify_shapes}
    graphs.stats.capture_s += 1.5
    assert dec.capture_clock() == graphs.stats.capture_s
