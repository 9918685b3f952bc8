"""CUDA graphs for speculative steps on the GPU (gpu marker): greedy output with speculation and graphs ==
speculation with `enforce_eager` == plain decoding, token for token (fp32), for DSpark on V4.1 (every verification
policy: mixed verify lengths per step) and on V4-0731, and for MTP on V4, with mixed prompt lengths and requests
finishing at different steps; verify steps replay captured (B, L, Q) graphs (`GraphStats.verify_replays`), the
draft passes theirs (`draft_replays` for the DSpark stages, `mtp_replays` for the MTP block), no capture fails."""

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
        assert any(q > 1 for _, _, q in st.verify_shapes), st.verify_shapes
        assert st.replays == 0 and not graphs.failed, (st, graphs.failed)  # no plain decode graph here
        if method == "dspark":  # the stages' parallel pass of every round
            assert st.draft_replays >= 10 and st.draft_eager_steps == 0, st
        else:  # the MTP block after every step without a prefill chunk
            assert st.mtp_replays >= 10, st
