"""Speculative decoding with the prefix cache (CPU, fp32, tiny checkpoints): a request that hits a long cached
prefix drafts exactly as the same request run without the cache, round by round. The draft layers' own rings
(DSpark stages on V4.1 / V4-0731, V4's MTP block) come back from the state block of the hit
(docs/prefix_cache.md "Speculative decoding"); outputs are the same greedy tokens either way."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
FIRST = [0] + list(range(100, 145))  # 46 ids in 10-token prefill chunks: 30..39, 40..45
# hits with 5 new rows (< the window, 8), so the drafts read restored rows; the next token differs from FIRST's:
INSIDE = FIRST[:32] + [7, 8, 9, 10, 11]  # at 32: a state block copied while the chunk 30..39 is computed
AT_END = FIRST[:40] + [7, 8, 9, 10, 11]  # at 40: a state block copied from the slot after the chunk 30..39


def _rounds(llm: LLM, prompt: list[int]) -> tuple[list[int], list[tuple], int]:
    """(greedy output, per round (accepted counts, verified drafts, draft logits), cached tokens)."""
    spec = llm.engine.runner.spec
    rounds: list[tuple] = []
    drafts: list[torch.Tensor] = []
    draft_block, update = spec.drafter.draft_block, spec.stats.update

    def record_draft(anchor_ids, anchor_positions):
        out = draft_block(anchor_ids, anchor_positions)
        drafts.append(out.base_logits.clone())
        return out

    def record_round(acc, num, **kw):
        rounds.append((list(acc), list(num), drafts[-1]))
        return update(acc, num, **kw)

    spec.drafter.draft_block, spec.stats.update = record_draft, record_round
    try:
        (out,) = llm.generate([prompt], SP, use_tqdm=False)
    finally:
        del spec.drafter.draft_block, spec.stats.update
    return list(out.outputs[0].token_ids), rounds, out.num_cached_tokens


@pytest.mark.parametrize(("arch", "size", "method", "page", "graphs"), [
    ("v41", "tiny", "dspark", 4, False), ("v4", "tiny-dspark", "dspark", 8, False), ("v4", "tiny", "mtp", 8, False),
    ("v41", "tiny", "dspark", 4, True)])
def test_a_prefix_hit_drafts_as_without_the_cache(tiny_ckpt, arch: str, size: str, method: str, page: int,
                                                  graphs: bool) -> None:  # fmt: skip
    """graphs: verify steps, draft passes and draft-ring writes through the runner's fixed-shape path (its capture
    replaced by an eager run, as in test_spec_graphs.py), with prefill chunks of 6 = k + 1 tokens, so that the
    steps whose state-block captures are armed could take the insertion graph: they must leave the draft-ring
    writes to the eager insertion, which serves the captures (without that check the drafts after a hit differ)."""
    path = tiny_ckpt(arch, size)
    llm = LLM(str(path), device="cpu", dtype="float32", page_size=page, max_num_batched_tokens=6 if graphs else 10,
              speculative_config={"method": method})
    if graphs:
        from deepinfer_engine.worker.cuda_graph import verify_row_sizes
        from eager_graphs import EagerReplayGraphs

        eng = llm.engine
        g = EagerReplayGraphs(eng.runner.model, eng.runner.cache, max_num_seqs=4, max_model_len=eng.max_model_len)
        eng.runner.cuda_graphs, spec = g, eng.runner.spec
        spec.drafter.block_runner, spec.insert_runner = g.run_draft, g.run_insert
        spec.graph_rows = {b: verify_row_sizes(b, spec.max_drafts + 1) for b in g.batch_sizes}
    kv = llm.engine.scheduler.kv
    want = []
    for prompt in (INSIDE, AT_END):  # the references: computed from position 0
        kv.reset_prefix_cache()
        want.append(_rounds(llm, prompt))
    kv.reset_prefix_cache()
    llm.generate([FIRST], SP, use_tqdm=False)
    for prompt, hit, (want_ids, want_rounds, cold) in zip((INSIDE, AT_END), (32, 40), want):
        got_ids, got_rounds, cached = _rounds(llm, prompt)
        assert cold == 0 and cached == hit  # a real hit, restored from a state block
        assert got_ids == want_ids
        assert len(want_rounds) >= 3 and [r[:2] for r in got_rounds] == [r[:2] for r in want_rounds]
        for (_, _, got), (_, _, ref) in zip(got_rounds, want_rounds):  # fp32: prefill chunks split differently
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    if graphs:
        st = llm.engine.runner.cuda_graphs.stats
        assert st.insert_replays > 0 and st.verify_replays > 0, st
