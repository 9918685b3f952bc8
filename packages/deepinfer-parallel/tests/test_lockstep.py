"""agree_step: the same step kind on every rank, by policy; idle and empty ranks; gloo ranks agree."""

from __future__ import annotations

import pytest
from deepinfer_parallel.errors import ParallelConfigError
from deepinfer_parallel.lockstep import agree_step
from deepinfer_parallel.state import ParallelState


def test_single_rank():
    s = ParallelState.single()
    assert agree_step(s, prefill_tokens=0, decode_tokens=0).kind == "idle"
    a = agree_step(s, prefill_tokens=5, decode_tokens=3, prefill_policy="all")
    assert (a.kind, a.max_tokens, a.per_rank, a.ranks_with_work) == ("prefill", 5, ((5, 3),), 1)
    assert agree_step(s, prefill_tokens=0, decode_tokens=3).max_tokens == 3
    with pytest.raises(ParallelConfigError, match="prefill_tokens"):
        agree_step(s, prefill_tokens=-1, decode_tokens=0)
    with pytest.raises(ParallelConfigError, match="prefill_policy"):
        agree_step(s, prefill_tokens=1, decode_tokens=0, prefill_policy="some")


# per rank (prefill, decode) of 3 ranks -> (kind with "any", kind with "all")
CASES = [
    (((0, 0), (0, 0), (0, 0)), ("idle", "idle")),
    (((8, 0), (0, 4), (0, 0)), ("prefill", "decode")),  # rank 1 only decodes: "all" keeps decoding
    (((8, 2), (6, 4), (0, 0)), ("prefill", "prefill")),  # every working rank has prompts; rank 2 runs empty steps
    (((0, 2), (0, 4), (0, 1)), ("decode", "decode")),
    (((3, 0), (0, 0), (0, 0)), ("prefill", "prefill")),  # nobody decodes: prefill even under "all"
]


def _agree(state):
    out = []
    for per_rank, _ in CASES:
        p, d = per_rank[state.rank]
        out.append((agree_step(state, prefill_tokens=p, decode_tokens=d, prefill_policy="any"),
                    agree_step(state, prefill_tokens=p, decode_tokens=d, prefill_policy="all")))
    return out


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_gloo_ranks_agree():
    from parallel_testing import run_ranks

    results = run_ranks(_agree, 3, timeout_s=80)
    assert results[0] == results[1] == results[2]
    for (per_rank, kinds), (a_any, a_all) in zip(CASES, results[0]):
        assert (a_any.kind, a_all.kind) == kinds
        assert a_any.per_rank == per_rank
    assert results[0][1][1].max_tokens == 4 and results[0][1][0].max_tokens == 8
