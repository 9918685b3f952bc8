"""HostStaging: packed host -> device copies from persistent pinned buffers. CPU: values, dtypes, shapes, no
aliasing between calls. GPU: results stay right when a buffer's turn comes while its copy is still pending
(in-flight steps of asynchronous scheduling), buffers grow for larger steps and are reused for smaller ones."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_engine.errors import InputError
from deepinfer_engine.worker.staging import HostStaging


def _parts(k: int) -> list[tuple[object, torch.dtype]]:
    n = 1 + k % 5
    return [
        ([k + i for i in range(n)], torch.int64),
        ([0.5 * k + i for i in range(3)], torch.float32),  # 12 bytes: the next part starts aligned
        (np.arange(2 * n, dtype=np.int64).reshape(2, n) * k, torch.int64),
        ([], torch.int64),
        ([k, -k, 7], torch.int32),
        ([0.1 * k, 1e-300], torch.float64),  # after 12 bytes: aligned to 8
    ]


def _check(got: list[torch.Tensor], parts: list[tuple[object, torch.dtype]]) -> None:
    for t, (v, dt) in zip(got, parts):
        want = torch.as_tensor(np.asarray(v), dtype=dt).reshape(np.asarray(v).shape)
        assert t.dtype == dt and t.shape == want.shape
        assert torch.equal(t.cpu(), want)


def test_cpu_parts_are_fresh_tensors() -> None:
    st = HostStaging("cpu")
    a = st.stage(_parts(3))
    _check(a, _parts(3))
    b = st.stage(_parts(4))
    a[0].fill_(-5)
    _check(b, _parts(4))  # no aliasing between calls
    src = np.array([1, 2, 3], dtype=np.int64)
    t = st.tensor(src, torch.int64)
    src[0] = 9
    assert t.tolist() == [1, 2, 3]  # nor with the caller's array
    with pytest.raises(InputError, match="found dtype torch.float16"):
        st.tensor([1.0], torch.float16)


@pytest.mark.gpu
def test_cuda_buffers_reused_while_copies_are_pending() -> None:
    st = HostStaging("cuda", slots=2, nbytes=64)  # small: the larger parts make it grow
    staged = []
    torch.cuda._sleep(200_000_000)  # the stream is busy: the copies below stay pending for a while
    for k in range(2):
        staged.append((st.stage(_parts(k)), _parts(k)))
    assert st.waits == 0  # two slots: two steps in flight without a wait
    for k in range(2, 9):  # every later call finds its slot's copy pending or done, never overwrites it early
        torch.cuda._sleep(20_000_000)
        staged.append((st.stage(_parts(k)), _parts(k)))
        staged.append((st.stage([(list(range(300 * k)), torch.int64)]), [(list(range(300 * k)), torch.int64)]))
    torch.cuda.synchronize()
    for got, parts in staged:
        _check(got, parts)
    assert st.waits >= 1  # the first reuse after the long sleep had to wait for its copy
