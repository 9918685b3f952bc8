"""Triton `embed_streams` vs the torch reference: exact (pure copies; ids past the table give zeros)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.embed import embed_streams, reference
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.embed.triton") as (mod,):
        yield mod


def _inputs(t: int, v: int, d: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(t + v + d)
    ids = torch.randint(0, v + 5, (t,), generator=g)  # some image ids past the table
    ids[:1] = v - 1
    return ids.to(device), torch.randn(v, d, generator=g).to(dtype).to(device)


@pytest.mark.parametrize(("t", "v", "d", "n"), [(5, 40, 24, 4), (3, 7, 1500, 2), (1, 3, 8, 1), (0, 5, 8, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_embed_streams_interpreter_matches_reference(interp, t, v, d, n, dtype):
    ids, w = _inputs(t, v, d, dtype)
    got = interp.embed_streams(ids, w, n)
    assert got.shape == (t, n, d) and torch.equal(got, reference.embed_streams(ids, w, n))


def test_embed_streams_dispatcher():
    ids, w = _inputs(4, 10, 16, torch.float32)
    want = reference.embed_streams(ids, w, 4)
    assert torch.equal(embed_streams(ids, w, 4, backend="torch"), want)
    assert torch.equal(want[:, 2], torch.where((ids < 10)[:, None], w[ids.clamp(max=9)], 0.0))
    with pytest.raises(ValueError, match="expected"):
        embed_streams(ids[:, None], w, 4)


def test_embed_kernel_compiles_for_sm90():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    script = r"""
import json
from kernels_testing import sm90_compile_report as rep
from deepinfer_kernels.embed import triton as et
print(json.dumps(rep(et._embed_streams_kernel, {"ids_ptr": "*i64", "w_ptr": "*bf16", "out_ptr": "*bf16", "V": "i32",
    "D": "i32", "stride_w": "i32"}, {"N": 4, "BLOCK": 1024}, num_warps=4)))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    support = str(Path(__file__).resolve().parent / "support")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (support, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                          check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["stack"] == 0, r


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 64])
def test_embed_streams_gpu_matches_reference(t):
    """V4.1 widths: 129,280 x 5120 bf16 table (a slice of rows suffices for the gather), 4 streams."""
    ids, w = _inputs(t, 4096, 5120, torch.bfloat16, "cuda")
    assert torch.equal(embed_streams(ids, w, 4, backend="triton"), reference.embed_streams(ids, w, 4))
