"""Programmatic dependent launch inside the decode CUDA graphs (gpu marker; docs/pdl.md): a tiny V4.1 engine's
graph-replayed decode steps give bit-identical logits with the engine option `pdl` on and off. On an sm_90+ device
the FP8 gemv (B = 1 steps), the RMSNorms and the rope kernels are then captured as programmatic dependent launches,
so this checks that the recorded programmatic edges order every read after the write it depends on."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine import LLM, SamplingParams
from engine_testing import make_tiny_checkpoint

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v41"), arch="v41", seed=0)


def _decode_logits(path, dtype: str, pdl: bool) -> tuple[list[torch.Tensor], list[list[int]], set]:
    """(logits of every graph-replayed decode step, in step order; greedy token ids; the shapes replayed)."""
    # a fixed cache budget: the four engines of this module would otherwise each take 90% of what is left free
    llm = LLM(str(path), device="cuda", dtype=dtype, max_num_seqs=4, async_scheduling=False, pdl=pdl,
              kv_cache_memory_bytes=1 << 30)
    assert {m.pdl for m in llm.engine.runner.model.modules()} == {pdl}
    graphs = llm.engine.runner.cuda_graphs
    assert graphs is not None
    seen: list[torch.Tensor] = []
    run = graphs.run

    def recording(batch, shape):
        out = run(batch, shape)
        if out is not None:
            seen.append(out.clone())  # the graph's buffer is rewritten by the next replay
        return out

    graphs.run = recording
    # max_tokens differ so the batch shrinks 4 -> 2 -> 1: the B = 1 graph runs the gemv (the PDL-enabled linear)
    prompts = [[5 + (7 * i + j) % 900 for j in range(n)] for i, n in enumerate((7, 12, 3, 30))]
    sps = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 6, 12, 3)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    return seen, [list(o.outputs[0].token_ids) for o in outs], {b for b, _ in graphs.stats.shapes}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_graph_logits_equal_with_pdl_on_and_off(ckpt, dtype: str) -> None:
    from deepinfer_kernels._pdl import use_pdl

    dev = torch.device("cuda")
    if torch.cuda.get_device_capability(dev) >= (9, 0):  # else the switch is a no-op and this compares plain runs
        assert use_pdl(True, dev, interpreted=False), "sm_90+ but the installed triton lacks the PDL API"
    on_logits, on_ids, on_shapes = _decode_logits(ckpt, dtype, pdl=True)
    off_logits, off_ids, _ = _decode_logits(ckpt, dtype, pdl=False)
    assert 1 in on_shapes and len(on_logits) >= 15, (on_shapes, len(on_logits))
    assert on_ids == off_ids
    assert len(on_logits) == len(off_logits)
    for i, (a, b) in enumerate(zip(on_logits, off_logits, strict=True)):
        assert torch.equal(a, b), f"{dtype} step {i}: max |on - off| = {(a - b).abs().max().item()}"
