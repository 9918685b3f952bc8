"""Triton RMSNorm and RoPE rotation vs the torch references (fp32 math, io in x's dtype).

Tolerances (|triton - reference| <= atol + rtol * |reference|):
- fp32: atol 1e-6, rtol 2e-6 (summation order of the mean of squares).
- bf16 / fp16: rtol 2^-7 (bf16) / 2^-10 (fp16) = 1 ULP, atol 1e-6: the fp32 results agree to ~1e-7 relative,
  the final rounding may land on the neighbouring value, and the CPU interpreter truncates instead of rounding.
RoPE: the kernel asks for no fp contraction (each product and sum rounded like the reference's separate ops);
tested within 1 ULP of the output dtype on the GPU (fp32: rtol 2^-23) and on the interpreter (numpy, bf16 / fp16
truncated; fp32 exact there).
RoPE at positions (angles and cos / sin computed in the kernel): the cos / sin of the kernel's math library may
differ from torch.polar's by an ULP of fp32, so the outputs are compared with atol 1e-5 (|x| <= ~10) on top of the
1-ULP relative tolerance. With the RMSNorm folded in (norm=(weight, eps)): fp32 atol 1e-5 / rtol 1e-5; bf16 the
norm's output rounding may land on the neighbouring value before the rotation: atol 2e-2 (normed values ~1),
rtol 2^-7.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.norm_rope import (
    apply_rope,
    apply_rope_at,
    reference,
    rms_norm,
    rope_at_uses_kernel,
    rope_cos_sin,
    rope_freqs,
)
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_TOL = {torch.float32: (1e-6, 2e-6), torch.bfloat16: (1e-6, 2.0**-7), torch.float16: (1e-6, 2.0**-10)}


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.norm_rope.triton") as (mod,):
        yield mod


def _check(out, ref):
    atol, rtol = _TOL[ref.dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# Shapes: D not a power of two (40, 1280, 5120), one row, rows not a multiple of the row block, 3-D input.
_SHAPES = [(1, 5120), (7, 40), (3, 5, 128), (33, 1280), (2, 16)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("with_weight", [True, False], ids=["w", "now"])
def test_interpreter_matches_reference(interp, shape, dtype, with_weight):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype) if with_weight else None
    _check(interp.rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))


def test_interpreter_strided_rows_tiny_eps_and_empty(interp):
    base = torch.randn(6, 96).to(torch.bfloat16)
    x = base[:, 8:72]  # row stride 96, last dim contiguous
    w = torch.rand(64) + 0.5  # fp32 weight on bf16 activations, as the checkpoint norms
    _check(interp.rms_norm(x, w, 1e-20), reference.rms_norm(x, w, 1e-20))
    xt = base.t()[:40]  # last dim not contiguous: copied
    _check(interp.rms_norm(xt, None, 1e-6), reference.rms_norm(xt, None, 1e-6))
    z = torch.zeros(3, 32)
    torch.testing.assert_close(interp.rms_norm(z, None, 1e-20), z)  # 0 * rsqrt(eps) stays 0
    assert interp.rms_norm(torch.zeros(0, 32), None, 1e-6).shape == (0, 32)


def test_dispatcher_routes_and_falls_back(interp):
    x = torch.randn(4, 48).to(torch.bfloat16)
    _check(rms_norm(x, None, 1e-6, backend="triton"), reference.rms_norm(x, None, 1e-6))
    x64 = torch.randn(4, 48, dtype=torch.float64)
    with pytest.raises(ValueError, match="rms_norm: backend='triton' has no kernel.*float64"):
        rms_norm(x64, None, 1e-6, backend="triton")
    torch.testing.assert_close(rms_norm(x64, None, 1e-6), reference.rms_norm(x64, None, 1e-6))


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 5120), (256, 5120), (256, 64, 512), (4096, 1280), (3, 7, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_matches_reference(shape, dtype):
    x = torch.randn(*shape, device="cuda").to(dtype)
    w = (torch.rand(shape[-1], device="cuda") + 0.5).to(dtype)
    _check(rms_norm(x, w, 1e-6, backend="triton"), reference.rms_norm(x, w, 1e-6))


# ------------------------------------------------------------------------------------------------ RoPE
_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _inputs(shape: tuple[int, ...], rope_dim: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(sum(shape) + rope_dim)
    x = (torch.randn(*shape, generator=g) * 2).to(dtype).to(device)
    pos = torch.randint(0, 70000, (shape[0],), generator=g).to(device)
    freqs = rope_freqs(rope_dim, 160000.0, yarn_factor=16, original_max_pos=65536).to(device)
    cos, sin = rope_cos_sin(pos, freqs)
    return x, cos, sin


# [T, D] (compressed entries), [T, H, D] (q / attention output), no leading channels, one token, odd row counts
_CASES = [((5, 32), 8), ((3, 4, 32), 8), ((1, 64, 512), 64), ((7, 3, 16), 16), ((2, 24), 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("case", _CASES, ids=lambda c: "x".join(map(str, c[0])) + f"-r{c[1]}")
@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "inv"])
def test_rope_interpreter_matches_reference(interp, case, dtype, inverse):
    shape, rope_dim = case
    x, cos, sin = _inputs(shape, rope_dim, dtype)
    out = interp.apply_rope(x, cos, sin, inverse=inverse)
    ref = reference.apply_rope(x, cos, sin, inverse=inverse)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    d = shape[-1] - rope_dim
    assert torch.equal(out[..., :d], ref[..., :d])  # leading channels are copied
    torch.testing.assert_close(out.float(), ref.float(), atol=0.0, rtol=_ULP[dtype])


def test_rope_interpreter_strided_input_and_empty(interp):
    base = torch.randn(4, 3, 48)
    x = base[:, :, 8:40]  # row stride 48: copied to contiguous rows
    cos, sin = rope_cos_sin(torch.arange(4), rope_freqs(8, 10000.0))
    torch.testing.assert_close(interp.apply_rope(x, cos, sin), reference.apply_rope(x, cos, sin), atol=0, rtol=0)
    assert interp.apply_rope(torch.zeros(0, 32), cos[:0], sin[:0]).shape == (0, 32)


def test_rope_dispatcher_routes_triton_and_keeps_float64_on_reference(interp):
    x, cos, sin = _inputs((3, 2, 32), 8, torch.float32)
    out = apply_rope(x, cos, sin, backend="triton")
    torch.testing.assert_close(out, reference.apply_rope(x, cos, sin), atol=0, rtol=0)
    x64 = x.double()
    torch.testing.assert_close(apply_rope(x64, cos, sin), reference.apply_rope(x64, cos, sin))


@pytest.mark.gpu
@pytest.mark.parametrize("case", [((1, 64, 512), 64), ((256, 64, 512), 64), ((8, 512), 64), ((3, 32, 128), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "inv"])
def test_gpu_rope_matches_reference(case, dtype, inverse):
    shape, rope_dim = case
    x, cos, sin = _inputs(shape, rope_dim, dtype, "cuda")
    out = apply_rope(x, cos, sin, inverse=inverse, backend="triton")
    ref = reference.apply_rope(x, cos, sin, inverse=inverse)
    d = shape[-1] - rope_dim
    assert out.dtype == ref.dtype and torch.equal(out[..., :d], ref[..., :d])
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-6, rtol=_ULP[dtype] or 2.0**-23)


def _positions_inputs(shape: tuple[int, ...], rope_dim: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(sum(shape) + rope_dim + 1)
    x = (torch.randn(*shape, generator=g) * 2).to(dtype).to(device)
    pos = torch.randint(0, 70000, (shape[0],), generator=g).to(device)
    freqs = rope_freqs(rope_dim, 160000.0, yarn_factor=16, original_max_pos=65536).to(device)
    return x, pos, freqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", _CASES[:3], ids=lambda c: "x".join(map(str, c[0])) + f"-r{c[1]}")
@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "inv"])
def test_rope_at_positions_interpreter_matches_reference(interp, case, dtype, inverse):
    shape, rope_dim = case
    x, pos, freqs = _positions_inputs(shape, rope_dim, dtype)
    out = interp.apply_rope_at(x, pos, freqs, inverse=inverse)
    ref = reference.apply_rope(x, *rope_cos_sin(pos, freqs), inverse=inverse)
    d = shape[-1] - rope_dim
    assert out.dtype == ref.dtype and out.shape == ref.shape and torch.equal(out[..., :d], ref[..., :d])
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-5, rtol=_ULP[dtype] or 2.0**-23)


def test_rope_at_dispatcher(interp):
    x, pos, freqs = _positions_inputs((3, 2, 32), 8, torch.float32)
    assert rope_at_uses_kernel(x, pos, freqs, backend="triton") and not rope_at_uses_kernel(x, pos, freqs,
                                                                                             backend="torch")
    ref = reference.apply_rope(x, *rope_cos_sin(pos, freqs))
    torch.testing.assert_close(apply_rope_at(x, pos, freqs, backend="torch"), ref, atol=0, rtol=0)
    torch.testing.assert_close(apply_rope_at(x, pos, freqs, backend="triton"), ref, atol=1e-5, rtol=2.0**-23)
    assert not rope_at_uses_kernel(x.double(), pos, freqs, backend="auto")
    with pytest.raises(ValueError, match="positions"):
        apply_rope_at(x, pos[:2], freqs)
    with pytest.raises(ValueError, match="rope dims"):
        apply_rope_at(x, pos, torch.ones(17))


_NORM_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2.0**-7)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", [((5, 40), 8), ((3, 4, 32), 8), ((2, 16), 16)],
                         ids=lambda c: "x".join(map(str, c[0])) + f"-r{c[1]}")  # fmt: skip
@pytest.mark.parametrize("weighted", [True, False], ids=["w", "now"])
def test_norm_rope_at_positions_interpreter_matches_reference(interp, case, dtype, weighted):
    shape, rope_dim = case
    x, pos, freqs = _positions_inputs(shape, rope_dim, dtype)
    w = (torch.rand(shape[-1], generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype) if weighted else None
    out = interp.apply_rope_at(x, pos, freqs, norm=(w, 1e-6))
    ref = reference.apply_rope(reference.rms_norm(x, w, 1e-6), *rope_cos_sin(pos, freqs))
    atol, rtol = _NORM_TOL[dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(apply_rope_at(x, pos, freqs, norm=(w, 1e-6), backend="torch"), ref, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [((1, 512), 64), ((64, 512), 64), ((3, 64, 512), 64), ((5, 128), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_norm_rope_at_positions_matches_reference(case, dtype):
    shape, rope_dim = case
    x, pos, freqs = _positions_inputs(shape, rope_dim, dtype, "cuda")
    w = (torch.rand(shape[-1], generator=torch.Generator().manual_seed(3)) + 0.5).to(dtype).cuda()
    for weight in (w, None):
        out = apply_rope_at(x, pos, freqs, norm=(weight, 1e-6), backend="triton")
        ref = reference.apply_rope(reference.rms_norm(x, weight, 1e-6), *rope_cos_sin(pos, freqs))
        atol, rtol = _NORM_TOL[dtype]
        torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [((1, 64, 512), 64), ((64, 64, 512), 64), ((8, 512), 64), ((3, 32, 128), 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("inverse", [False, True], ids=["fwd", "inv"])
def test_gpu_rope_at_positions_matches_reference(case, dtype, inverse):
    shape, rope_dim = case
    x, pos, freqs = _positions_inputs(shape, rope_dim, dtype, "cuda")
    out = apply_rope_at(x, pos, freqs, inverse=inverse, backend="triton")
    ref = reference.apply_rope(x, *rope_cos_sin(pos, freqs), inverse=inverse)
    d = shape[-1] - rope_dim
    assert out.dtype == ref.dtype and torch.equal(out[..., :d], ref[..., :d])
    torch.testing.assert_close(out.float(), ref.float(), atol=1e-5, rtol=_ULP[dtype] or 2.0**-23)


# ------------------------------------------------------------------------------------------------ PDL
class _GdcCounter:
    """Stands in for triton's gdc_wait / gdc_launch_dependents on the interpreter, which cannot run griddepcontrol
    (calling them there raises): counts the calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_pdl_interpreter_is_bit_identical(interp, monkeypatch):
    """pdl=True on the interpreter launches plainly (the wait compiled out): bit-identical to pdl=False. Then the
    PDL variants (PDL=True constexpr: the RMSNorm weight read before the wait) run with the griddepcontrol calls
    counted instead of executed: bit-identical again, one wait and one trigger per program."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(9, 40, generator=g) * 3).bfloat16()
    w = (torch.rand(40, generator=g) + 0.5).bfloat16()
    xr, cos, sin = _inputs((3, 4, 32), 8, torch.bfloat16)
    xp, pos, freqs = _positions_inputs((3, 4, 32), 8, torch.bfloat16)

    def run(pdl: bool) -> list[torch.Tensor]:
        return [interp.rms_norm(x, w, 1e-6, pdl=pdl), interp.rms_norm(x, None, 1e-6, pdl=pdl),
                interp.apply_rope(xr, cos, sin, pdl=pdl), interp.apply_rope_at(xp, pos, freqs, pdl=pdl),
                interp.apply_rope_at(xp, pos, freqs, norm=(None, 1e-6), pdl=pdl)]  # fmt: skip

    plain = run(False)
    for a, b in zip(run(True), plain, strict=True):
        assert torch.equal(a, b)
    wait, trigger = _GdcCounter(), _GdcCounter()
    monkeypatch.setattr(interp, "gdc_wait", wait)
    monkeypatch.setattr(interp, "gdc_launch_dependents", trigger)
    monkeypatch.setattr(interp, "use_pdl", lambda requested, device, interpreted: requested)
    for a, b in zip(run(True), plain, strict=True):
        assert torch.equal(a, b)
    # rms_norm [9, 40]: 8192 // 64 rows per program -> 1 program each; rope [12 rows]: 1 program each
    assert wait.calls == trigger.calls == 5
    _check(plain[0], reference.rms_norm(x, w, 1e-6))


@pytest.mark.gpu
def test_gpu_pdl_chain_is_bit_identical():
    """Back-to-back RMSNorm and RoPE launches (each reading the previous output), eager and in a CUDA graph: pdl on
    equals pdl off bit for bit (plain launches on a device without PDL)."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(1, 64, 512, generator=g).cuda().bfloat16()
    w = (torch.rand(512, generator=g) + 0.5).cuda().bfloat16()
    pos = torch.tensor([70000]).cuda()
    freqs = rope_freqs(64, 160000.0, yarn_factor=16, original_max_pos=65536).cuda()

    def chain(pdl: bool) -> list[torch.Tensor]:
        outs, h = [], x
        for _ in range(4):
            h = rms_norm(h, w, 1e-6, backend="triton", pdl=pdl)
            outs.append(h)
            h = apply_rope_at(h, pos, freqs, backend="triton", pdl=pdl)
            outs.append(h)
            h = apply_rope_at(h, pos, freqs, norm=(w, 1e-6), inverse=True, backend="triton", pdl=pdl)
            outs.append(h)
        return outs

    off = chain(False)
    for a, b in zip(chain(True), off, strict=True):
        assert torch.equal(a, b)
    chain(True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chain(True)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(outs, off, strict=True):
            assert torch.equal(a, b)
