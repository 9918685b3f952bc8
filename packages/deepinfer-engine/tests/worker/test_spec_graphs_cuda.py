"""CUDA graphs for speculative steps on the GPU (gpu marker): greedy output with speculation and graphs ==
speculation with `enforce_eager` == plain decoding, token for token (fp32), for DSpark on V4.1 (every verification
policy: mixed verify lengths per step) and on V4-0731, and for MTP on V4, with mixed prompt lengths and requests
finishing at different steps; verify steps replay captured ragged (B, L, T) graphs (`GraphStats.verify_replays`), the
draft passes theirs (`draft_replays` for the DSpark stages, `mtp_replays` for the MTP block), DSpark's draft-ring
writes theirs (`insert_replays`), no capture fails, and DSpark rounds take the drafts launched ahead at the previous
round's read (`SpecTiming.ahead_used`).
A DSpark round's pass + Markov sampling replayed as one graph gives the eager sampling's proposal bit for bit
(greedy, mixed and all-sampled rounds). The draft-ring writes replayed as a graph equal the eager ones on the same
features (ring rows and next drafts)."""

from __future__ import annotations

import pytest
from deepinfer_engine import LLM, SamplingParams
from deepinfer_engine.model.writer import make_checkpoint

pytestmark = pytest.mark.gpu

CASES = {"v41": ("v41", "tiny", "dspark"), "v4-0731": ("v4", "tiny-dspark", "dspark"), "v4": ("v4", "tiny", "mtp")}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("specgraphs")
    return {name: make_checkpoint(root / name, arch, preset, 0) for name, (arch, preset, _) in CASES.items()}


def _generate(llm: LLM) -> list[list[int]]:
    # lengths across the window and compressed-entry boundaries; max_tokens differ so requests finish at
    # different steps (the batch bucket shrinks); a second call joins new requests to a fresh batch
    prompts = [[5 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate((7, 12, 3, 30, 17, 1))]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (20, 6, 13, 9, 16, 3)]
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    second = llm.generate([{"prompt_token_ids": p[::-1]} for p in prompts[:3]],
                          SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)  # fmt: skip
    return [list(o.outputs[0].token_ids) for o in first + second]


def _llm(path, method: str | None, *, eager: bool, policy: str = "verify_all") -> LLM:
    spec = {} if method is None else {"speculative_config": {"method": method, "policy": policy}}
    return LLM(str(path), device="cuda", dtype="float32", max_num_seqs=4, enforce_eager=eager,
               enable_prefix_caching=False, **spec)  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_greedy_speculation_with_graphs_equals_eager_and_plain(ckpts, name: str) -> None:
    path, method = ckpts[name], CASES[name][2]
    plain = _generate(_llm(path, None, eager=True))
    eager = _generate(_llm(path, method, eager=True))
    assert eager == plain, (name, "eager speculation")
    policies = ("verify_all", "threshold", "cost") if name == "v41" else ("verify_all",)
    for policy in policies:
        llm = _llm(path, method, eager=False, policy=policy)
        graphs = llm.engine.runner.cuda_graphs
        out = _generate(llm)
        assert out == plain, (name, policy, "graphed speculation")
        st = graphs.stats
        # every decode step of a speculative engine is a verify step; only prefill steps run eagerly
        assert st.verify_replays >= 10 and st.verify_captures == len(set(st.verify_shapes)), st
        assert any(t > b for b, _, t in st.verify_shapes), st.verify_shapes  # ragged: more rows than sequences
        assert st.replays == 0 and not graphs.failed, (st, graphs.failed)  # no plain decode graph here
        if method == "dspark":  # the stages' parallel pass of every round
            assert st.draft_replays >= 10 and st.draft_eager_steps == 0, st
            # the draft-ring writes of every step keeping <= k + 1 rows per sequence (not comparable with
            # verify_replays: the cost policy's start-up profile replays verify graphs without a round)
            assert st.insert_replays >= 10 and st.insert_eager_steps >= 1, st  # prefill steps: eager
            # draft-ahead is on with graphs: rounds took the drafts launched at the previous round's read (the
            # requests finish at different steps, so some rounds took a subset of them or drafted their own)
            spec = llm.engine.runner.spec
            timing = spec.timing
            assert spec.draft_ahead and timing.ahead_used >= 5, timing
            if policy != "verify_all":  # the decision behind the draft pass, on every round (forced busy)
                spec.device_busy, spec.explore_every = (lambda: True), 0  # no exploration round's verify_all
                spec.decide_on_device = True
                spec.reset_stats()
                assert _generate(llm) == plain, (name, policy, "decided on the device")
                assert spec.timing.decided == spec.timing.rounds > 0, spec.timing
        else:  # the MTP block after every step without a prefill chunk
            assert st.mtp_replays >= 10, st


def test_fused_draft_round_equals_the_pass_then_eager_sampling(ckpts) -> None:
    """`StageDrafter.propose_block` (one graph: the stages' pass, the Markov loop, the confidence) == the pass's
    graph followed by the eager `sample_block`, bit for bit, for greedy, mixed and all-sampled rounds of 3
    requests (bucket 4: one padding block), with a greedy head and per-position STS sets. The fused graphs are
    captured after the engine's verify graphs (new heads after a generate), and every other graph is replayed
    between the fused round and the comparison, as the round's verify forward is: their proposal outputs must
    survive that (the verify reads them). Between a fused graph's capture and the replay compared, small device
    tensors are allocated and filled: a constant the graph reads but does not keep alive (its STS divisors, once)
    would then hold garbage, as it did in long benchmark runs."""
    import torch
    from deepinfer_dspark import propose

    llm = _llm(ckpts["v41"], "dspark", eager=False)
    spec, graphs = llm.engine.runner.spec, llm.engine.runner.cuda_graphs
    _generate(llm)  # verify graphs of several shapes, captured before the fused graphs below
    drafter = spec.drafter
    g = torch.Generator().manual_seed(0)
    width = drafter.heads.confidence.numel()
    drafter.set_heads(sts=(1.0, 0.5, 2.0, 0.8, 1.3)[: drafter.block_size], greedy_sts=0.7,
                      greedy_confidence=torch.randn(1, width, generator=g))
    slots, anchors, positions = [2, 0, 1], [17, 300, 5], [9, 40, 23]
    dev = torch.device("cuda")
    drafter.slots = torch.tensor(slots, device=dev)
    drafter.round_host = (slots, anchors, positions)
    a, p = torch.tensor(anchors, device=dev), torch.tensor(positions, device=dev)
    seeds = torch.tensor([3, -7, 1 << 40], device=dev)
    fused = drafter.proposal_runner
    for temp in ([0.0, 0.0, 0.0], [0.0, 0.9, 0.0], [0.7, 1.0, 1.6]):
        t = torch.tensor(temp)
        sampled = any(x > 0 for x in temp)
        drafter.proposal_runner = fused
        propose(drafter, a, p, temperature=t, seeds=seeds if sampled else None)  # captures this round's graph
        churn = [torch.full((n,), -3.0e4, device=dev) for n in (1, 5, 8, 64, 128) for _ in range(400)]
        del churn  # blocks freed since the capture were handed out and overwritten
        before = graphs.stats.draft_replays
        got = propose(drafter, a, p, temperature=t, seeds=seeds if sampled else None)
        # (not the insertion graphs: a replay writes its last round's ring rows again, stale by now; they share
        # no pool with the proposal)
        others = [k for k in graphs.graphs if not (k[0] == "draft" and len(k) == 5) and k[0] != "insert"]
        assert any(len(k) == 3 and k[0] != "draft" for k in others), others  # verify graphs exist
        for k in others:
            graphs.graphs[k].graph.replay()
        drafter.proposal_runner = None
        want = propose(drafter, a, p, temperature=t, seeds=seeds if sampled else None)
        assert graphs.stats.draft_replays == before + 2  # fused, then the pass alone
        assert torch.equal(got.draft_ids, want.draft_ids), temp
        assert torch.equal(got.confidence, want.confidence), temp
        assert (got.draft_probs is None) == (want.draft_probs is None), temp
        assert got.draft_probs is None or torch.equal(got.draft_probs, want.draft_probs), temp
    drafter.proposal_runner = fused
    assert not graphs.failed


def test_insert_graph_writes_the_eager_rings(ckpts) -> None:
    """`CudaGraphRunner.run_insert` (the draft-ring writes of a step's kept positions, one captured graph per batch
    bucket) == the eager `insert_context` on the same features: the same ring rows of every request slot and the
    same next draft passes (support/insert_rounds.py: kept lengths 0, 1, partial and N + 1, buckets with padding
    rows and padding sequences), every round replayed, no capture failed. fp32 with full-precision matmuls:
    only the GEMM row counts differ (B * Q rows against the kept ones)."""
    import torch
    from deepinfer_engine.model.loader import load_model
    from deepinfer_engine.worker.cuda_graph import CudaGraphRunner
    from insert_rounds import insert_cache, insert_rounds

    dev = torch.device("cuda")
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # TF32 would cost ~1e-3 and hide real differences
    try:
        model = load_model(ckpts["v41"], torch.float32, device=dev).eval()
        cache, bt = insert_cache(model, dev)
        graphs = CudaGraphRunner(model, cache, device=dev, max_num_seqs=4, max_model_len=256)
        rounds = insert_rounds(model, graphs, bt, dev, tol=1e-4)
    finally:
        torch.set_float32_matmul_precision(old)
    st = graphs.stats
    assert st.insert_replays == len(rounds) and st.insert_captures == 2 and not graphs.failed, (st, graphs.failed)


def test_cuda_busy_sees_queued_work_without_waiting() -> None:
    """`cuda_busy` (the policy warms its code while it is True): True while the stream still runs a queued kernel,
    False once it has finished; asking does not wait."""
    import time

    import torch
    from deepinfer_engine.worker.spec_decode import cuda_busy

    torch.cuda.synchronize()
    assert not cuda_busy()
    torch.cuda._sleep(200_000_000)  # a kernel spinning for well over 10 ms
    t0 = time.perf_counter()
    assert cuda_busy()
    assert time.perf_counter() - t0 < 5e-3
    torch.cuda.synchronize()
    assert not cuda_busy()
