"""Read-back buffers of asynchronous scheduling on CUDA (gpu marker): `AsyncOutput` with a `ReadbackPool` gives
each in-flight step its own pinned buffer, every result equals its device tensors (ids, logprobs, a packed
speculative result; mixed dtypes at aligned offsets), a buffer comes back to the pool only after its result was
read, and an output dropped unread never hands its buffer to another step."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.worker.async_output import AsyncOutput, ReadbackPool
from deepinfer_engine.worker.model_runner import LaunchedStep

pytestmark = pytest.mark.gpu


def _collect(step: LaunchedStep, drop=frozenset()):
    return (step.token_ids.tolist(), [t.tolist() for t in step.logprobs] if step.logprobs else None,
            None if step.spec_packed is None else step.spec_packed.tolist())


def test_pool_buffers_round_trip_in_flight_and_dropped() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    dev = torch.device("cuda")
    pool, side = ReadbackPool(), torch.cuda.Stream(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    pending, seen = [], set()
    for k in range(12):
        n = 1 + k % 5
        ids = torch.randint(0, 129280, (n,), device=dev, generator=gen)
        lp = (torch.rand(n, device=dev, generator=gen), torch.randint(0, 9, (n, 3), device=dev, generator=gen))
        packed = torch.randint(-1, 50, (n, 7), device=dev, generator=gen) if k % 3 == 0 else None
        torch.cuda._sleep(2_000_000)  # the copies queue behind slow work: results must wait for them
        step = LaunchedStep(token_ids=ids, logprobs=lp, spec_packed=packed)
        out = AsyncOutput(step, _collect, copy_stream=side, pool=pool)
        seen.add(id(out._slot))
        want = (ids.tolist(), [t.tolist() for t in lp], None if packed is None else packed.tolist())
        del ids, lp, packed, step  # the output keeps its device tensors alive until the copy ran
        torch.empty(1 << 20, device=dev).fill_(7)  # reuse of freed memory by the compute stream
        pending.append((out, want))
        if k == 5:
            dropped = pending.pop()[0]  # never read: its buffer must stay out of the pool
        if len(pending) == 3:  # two steps in flight, as in the engine loop
            o, w = pending.pop(0)
            assert o.result() == w
            assert o.token_ids() == w[0]  # still available after the buffer went back to the pool
    for o, w in pending:
        assert o.result() == w
    assert dropped._slot is not None and all(s is not dropped._slot for s in pool._free)
    assert len(seen) < 12, "the pool never reused a buffer"
