"""Sampler: rows whose logits are not finite come back as INVALID_TOKEN inside the sampled ids (no second
tensor, no extra host read); the other rows of the batch are sampled exactly as without the bad rows."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.sampling_params import SamplingParams
from deepinfer_engine.worker.sampler import INVALID_TOKEN, Sampler, build_sampling_batch


def _batch(params: list[SamplingParams], device: str = "cpu"):
    n = len(params)
    return build_sampling_batch(params, list(range(7, 7 + n)), [0] * n, [[1, 2]] * n, [[]] * n, [()] * n,
                                torch.device(device))


@pytest.mark.parametrize("greedy", [True, False])
def test_non_finite_rows_are_flagged_and_the_rest_unchanged(greedy: bool) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=g)
    bad = logits.clone()
    bad[1, 3] = float("nan")
    bad[2, 7] = float("inf")
    bad[3] = float("-inf")  # nothing can be sampled from an all -inf row
    sp = SamplingParams(temperature=0 if greedy else 0.8, top_p=1.0 if greedy else 0.9, logprobs=2)
    params = [sp] * 5
    want = Sampler()(logits, _batch(params))
    got = Sampler()(bad, _batch(params))
    ids = got.token_ids.tolist()
    assert [i for i, t in enumerate(ids) if t == INVALID_TOKEN] == [1, 2, 3]
    for row in (0, 4):
        assert ids[row] == want.token_ids[row].item()
        assert got.logprobs[0][row].item() == pytest.approx(want.logprobs[0][row].item())
    # a row with -inf entries but finite maximum is a normal row (banned tokens look like that)
    part = logits.clone()
    part[0, :10] = float("-inf")
    assert Sampler()(part, _batch(params)).token_ids[0].item() != INVALID_TOKEN


@pytest.mark.gpu
def test_sampler_makes_no_host_sync_on_cuda() -> None:
    logits = torch.randn(4, 1000, device="cuda")
    logits[2, 5] = float("nan")
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7, top_k=20, seed=3)] * 2
    batch = _batch(params, "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = Sampler()(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.tolist()[2] == INVALID_TOKEN


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_plain_greedy_is_argmax_with_bad_rows_flagged(device: str) -> None:
    # greedy without penalties / banned ids / logprobs takes the fused path (Triton two-stage argmax on CUDA)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 129280, generator=g).to(device)
    logits[0, [7, 100000]] = logits[0].max() + 1  # tie across chunks: the lowest index
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    logits[4, 9] = float("inf")
    out = Sampler()(logits, _batch([SamplingParams(temperature=0)] * 6, device))
    want = logits.argmax(dim=-1)
    want[[1, 2, 4]] = INVALID_TOKEN
    assert torch.equal(out.token_ids, want) and out.token_ids[0].item() == 7 and out.logprobs is None
