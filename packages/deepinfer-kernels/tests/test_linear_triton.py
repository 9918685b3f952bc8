"""Triton `linear` kernels vs the torch references: CPU interpreter at tiny irregular shapes; `gpu` at V4.1 / V4
shapes (M = 1..256).

Tolerances: fp32 (exact fp32 dots): atol 1e-5 relative to max |ref|; act_quant in fp32 is bit-identical in the
quantized activations, so the same. bf16 interpreter: 1 ULP (it truncates f32 -> bf16). bf16 GPU: max |Δ| <=
1e-2 max |ref| (bf16 output rounding + fp32 accumulation order vs cuBLAS). LM head (bf16 in, fp32 out) vs the
fp32 reference: max |Δ| <= 1e-5 max |ref| (same products, different summation order).

Every decode mode forms the reference's products exactly ("weight": the scaled tile is the reference's decoded
weight rounded to the dot dtype; "group": each scale group's dot over the raw codes times the group's power-of-two
weight / activation scales; "fma": fp32 products), only the fp32 summation order differs, so the fp32 tolerance
above covers all three. Split-K sums the partial tiles inside the kernel in the fixed split order:
two calls give identical bits, and split vs unsplit results differ only by fp32 summation order (same 1e-5).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from deepinfer_kernels._launch import next_pow2
from deepinfer_kernels.linear import reference
from deepinfer_kernels.quant import quant_fp8_block
from kernels_testing import LINEAR_MODULES, triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter(*LINEAR_MODULES) as (*_, mod):
        yield mod


@pytest.mark.parametrize(
    ("m", "n", "k", "block"), [(3, 40, 96, (32, 32)), (17, 33, 70, (32, 32)), (2, 130, 256, (128, 128))]
)
def test_fp8_linear_interpreter(interp, m, n, k, block):
    g = torch.Generator().manual_seed(m + n)
    q, s = quant_fp8_block(torch.randn(n, k, generator=g) / k**0.5, block)
    x = torch.randn(m, k, generator=g)
    for aq in (False, True):
        got = interp.fp8_linear(x, q, s, block, act_quant=aq)
        assert _rel(got, reference.fp8_linear(x, q, s, block, act_quant=aq)) <= 1e-5, aq
    xb = x.bfloat16()
    got = interp.fp8_linear(xb, q, s, block, act_quant=True)
    want = reference.fp8_linear(xb, q, s, block, act_quant=True)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize(("shape", "group"), [((3, 100), 32), ((2, 4096), 32), ((5, 2, 300), 128), ((4, 33), 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_fake_quant_is_the_reference_bit_for_bit(interp, shape, group, dtype):
    """The one-pass activation quantization the FP8 GEMMs read (bf16 / fp32 x): q * s is exact in both dtypes,
    so it equals the reference's fake quantization exactly, partial last groups and all-zero groups included."""
    from deepinfer_kernels.quant import fake_quant_act_fp8

    g = torch.Generator().manual_seed(shape[-1] + group)
    x = (torch.randn(shape, generator=g) * torch.logspace(-6, 3, shape[-1])).to(dtype)
    x[..., :group] = 0  # a whole zero group: the amax floor
    got = interp.act_fake_quant(x, group)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, fake_quant_act_fp8(x, group).to(dtype))


def test_act_fake_quant_refuses_fp16_and_odd_groups(interp):
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        interp.act_fake_quant(torch.zeros(2, 64, dtype=torch.float16), 32)
    with pytest.raises(ValueError, match="power of two"):
        interp.act_fake_quant(torch.zeros(2, 64), 24)


@pytest.mark.parametrize(("n", "k", "block", "e8m0"), [(40, 96, (32, 32), True), (130, 256, (128, 128), True),
                                                    (33, 70, (32, 32), False)])
def test_dequant_fp8_is_the_reference_decode(interp, n, k, block, e8m0):
    from deepinfer_kernels.quant import dequant_fp8_block

    g = torch.Generator().manual_seed(n)
    q, s = quant_fp8_block(torch.randn(n, k, generator=g) / k**0.5, block, **({} if e8m0 else {"scale_fmt": None}))
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        assert torch.equal(interp.dequant_fp8(q, s, block, dt), dequant_fp8_block(q, s, block).to(dt)), dt


def test_dense_mode_is_the_reference_computation(interp):
    """Mode "dense" (prefill sizes: decode the weight once, one matmul) computes what the reference computes: plain
    calls, with and without activation quantization, equal it bit for bit; grouped calls (one batched matmul against
    a matmul per group) within fp32 summation order."""
    cfg = interp.LinearConfig(16, 64, 128, 4, 1, 0, False, "dense")
    g = torch.Generator().manual_seed(5)
    q, s = quant_fp8_block(torch.randn(72, 96, generator=g) / 10, (32, 32))
    for dt in (torch.float32, torch.bfloat16):
        x = torch.randn(6, 96, generator=g).to(dt)
        for aq in (False, True):
            want = reference.fp8_linear(x, q, s, (32, 32), act_quant=aq)
            assert torch.equal(interp.fp8_linear(x, q, s, (32, 32), act_quant=aq, config=cfg), want), (dt, aq)
    xg = torch.randn(4, 3, 96, generator=g)
    got = interp.fp8_linear_grouped(xg, q[:64].repeat(3, 1)[:192], s[:2].repeat(3, 1)[:6], (32, 32), act_quant=True,
                                    config=cfg)  # fmt: skip
    for i in range(3):
        want = reference.fp8_linear(xg[:, i], q[:64], s[:2], (32, 32), act_quant=True)
        assert _rel(got[:, i * 64 : (i + 1) * 64], want) <= 1e-6, i  # bmm vs one matmul: summation order
    with pytest.raises(ValueError, match="dense"):
        interp.linear_f32_out(torch.randn(2, 32), torch.randn(8, 32), config=cfg)


def test_default_config_takes_dense_from_dense_min_rows():
    from deepinfer_kernels.linear import triton as lt

    m = lt.DENSE_MIN_ROWS
    assert lt.default_config(m, 4096, 1024, 32, torch.bfloat16).mode == "dense"
    assert lt.default_config(m - 1, 4096, 1024, 32, torch.bfloat16).mode != "dense"
    assert lt.default_config(m, 4096, 1024, 1, torch.bfloat16).mode != "dense"  # a plain weight (LM head)


def test_fp8_linear_interpreter_float32_scales(interp):
    g = torch.Generator().manual_seed(3)
    q, s = quant_fp8_block(torch.randn(20, 128, generator=g), 128, scale_fmt=None)
    assert s.dtype == torch.float32
    x = torch.randn(2, 128, generator=g)
    assert (
        _rel(
            interp.fp8_linear(x, q, s, (128, 128), act_quant=False), reference.fp8_linear(x, q, s, (128, 128))
        )
        <= 1e-5
    )


@pytest.mark.parametrize(
    ("m", "n", "k", "block", "block_k", "split", "swap", "mode"),
    [
        (3, 40, 200, (32, 32), 32, 3, False, "group"),
        (17, 33, 70, (32, 32), 64, 2, True, "group"),
        (2, 20, 384, (128, 128), 128, 3, True, "group"),
        (3, 40, 200, (32, 32), 64, 3, False, "weight"),
        (17, 33, 70, (32, 32), 64, 2, True, "weight"),
        (3, 40, 200, (32, 32), 64, 2, False, "fma"),
    ],
)
def test_fp8_linear_interpreter_split_k(interp, m, n, k, block, block_k, split, swap, mode):
    """In-kernel split-K reduction (several M and N tiles, so several arrival counters; a ragged last split and a
    K tail), several scale groups per K tile, the swapped (yᵀ = W xᵀ) orientation and the three decode modes
    ("fma" with 2-row M tiles): equal to the reference and to the unsplit kernel up to fp32
    summation order, and bit-identical across calls."""
    g = torch.Generator().manual_seed(k)
    q, s = quant_fp8_block(torch.randn(n, k, generator=g) / k**0.5, block)
    x = torch.randn(m, k, generator=g)
    bm = 2 if mode == "fma" else 16
    cfg = interp.LinearConfig(bm, 16, block_k, 4, 1, split, swap, mode)
    one = interp.LinearConfig(16, 16, block_k, 4, 1, 1)
    for aq in (False, True):
        got = interp.fp8_linear(x, q, s, block, act_quant=aq, config=cfg)
        want = reference.fp8_linear(x, q, s, block, act_quant=aq)
        assert _rel(got, want) <= 1e-5, aq
        assert _rel(got, interp.fp8_linear(x, q, s, block, act_quant=aq, config=one)) <= 1e-5, aq
        assert torch.equal(got, interp.fp8_linear(x, q, s, block, act_quant=aq, config=cfg)), aq
    yb = interp.fp8_linear(x.bfloat16(), q, s, block, act_quant=False, config=cfg)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb, reference.fp8_linear(x.bfloat16(), q, s, block), rtol=2**-7, atol=2e-2)


@pytest.mark.parametrize(
    ("m", "n", "k", "block", "block_m", "block_k", "split", "prefetch"),
    [
        (3, 40, 200, (32, 32), 2, 64, 3, 2),  # K tail, ragged last split, 2 M tiles x 3 N tiles of counters
        (1, 20, 384, (128, 128), 1, 128, 2, 1),  # V4 blocks (a scale group of 8 vectors)
        (2, 33, 96, (32, 32), 4, 64, 1, 0),  # N tail, unsplit, a K tail of whole 16-code vectors
    ],
)
def test_fp8_linear_interpreter_gemv(interp, m, n, k, block, block_m, block_k, split, prefetch):
    """"gemv" mode (int32 words of codes decoded in registers, CUDA-core FMAs, register prefetch 0 / 1 / 2): equal
    to the reference for fp32 (1e-5), fp16 and bf16 activations, with and without act_quant; split-K bit-identical
    across calls with the caller's counters left zero."""
    g = torch.Generator().manual_seed(k + n)
    q, s = quant_fp8_block(torch.randn(n, k, generator=g) / k**0.5, block)
    x = torch.randn(m, k, generator=g)
    cfg = interp.LinearConfig(block_m, 16, block_k, 4, 1, split, False, "gemv", prefetch=prefetch)
    cnt = torch.zeros(16, dtype=torch.int32)
    for aq in (False, True):
        got = interp.fp8_linear(x, q, s, block, act_quant=aq, config=cfg, counters=cnt)
        assert _rel(got, reference.fp8_linear(x, q, s, block, act_quant=aq)) <= 1e-5, aq
        assert not cnt.any()
        if split > 1:
            assert torch.equal(got, interp.fp8_linear(x, q, s, block, act_quant=aq, config=cfg, counters=cnt)), aq
    for dt in (torch.bfloat16, torch.float16):
        got = interp.fp8_linear(x.to(dt), q, s, block, act_quant=dt == torch.bfloat16, config=cfg)
        want = reference.fp8_linear(x.to(dt), q, s, block, act_quant=dt == torch.bfloat16)
        assert got.dtype == dt
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2e-2)


def test_fp8_linear_grouped_interpreter_gemv(interp):
    """"gemv" on the block-diagonal form with x a strided [M, G, K] view (read as int64 words, strides in words)."""
    gen = torch.Generator().manual_seed(9)
    m, groups, rows, k, block = 2, 3, 32, 64, (32, 32)
    q, s = quant_fp8_block(torch.randn(groups * rows, k, generator=gen) / k**0.5, block)
    x = torch.randn(m, groups * k + 8, generator=gen)[:, 8:].view(m, groups, k)
    cfg = interp.LinearConfig(2, 16, 32, 4, 1, 2, False, "gemv")
    got = interp.fp8_linear_grouped(x.bfloat16(), q, s, block, act_quant=False, config=cfg).view(m, groups, rows)
    for g in range(groups):
        want = reference.fp8_linear(x[:, g].bfloat16(), q[g * rows : (g + 1) * rows], s[g : g + 1], block)
        torch.testing.assert_close(got[:, g], want, rtol=2**-7, atol=2e-2)


class _GdcCounter:
    """Stands in for triton's gdc_wait / gdc_launch_dependents on the interpreter, which cannot run griddepcontrol
    (calling them there raises): counts the calls, so a test sees that every program reaches the wait."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


@pytest.mark.parametrize(("m", "n", "k", "block_k", "split", "prefetch"),
                         [(1, 40, 200, 64, 3, 2), (1, 20, 384, 128, 2, 1), (2, 33, 96, 64, 1, 0)])  # fmt: skip
def test_fp8_linear_interpreter_gemv_pdl(interp, monkeypatch, m, n, k, block_k, split, prefetch):
    """pdl=True on the interpreter: launched plainly (`use_pdl` is False there, the wait compiled out), so the
    result is bit-identical to pdl=False. Then the PDL variant itself (PDL=True constexpr, weight loads before the
    wait) is run with the two griddepcontrol calls counted instead of executed: bit-identical again, equal to the
    reference, and every program calls the wait and the trigger exactly once."""
    g = torch.Generator().manual_seed(k + n + 1)
    q, s = quant_fp8_block(torch.randn(n, k, generator=g) / k**0.5, (32, 32))
    x = torch.randn(m, k, generator=g).bfloat16()
    cfg = interp.LinearConfig(next_pow2(m), 16, block_k, 4, 1, split, False, "gemv", prefetch=prefetch)
    plain = interp.fp8_linear(x, q, s, (32, 32), act_quant=False, config=cfg)
    assert torch.equal(interp.fp8_linear(x, q, s, (32, 32), act_quant=False, config=cfg, pdl=True), plain)
    wait, trigger = _GdcCounter(), _GdcCounter()
    monkeypatch.setattr(interp, "gdc_wait", wait)
    monkeypatch.setattr(interp, "gdc_launch_dependents", trigger)
    monkeypatch.setattr(interp, "use_pdl", lambda requested, device, interpreted: requested)
    got = interp.fp8_linear(x, q, s, (32, 32), act_quant=False, config=cfg, pdl=True)
    assert torch.equal(got, plain)
    torch.testing.assert_close(got, reference.fp8_linear(x, q, s, (32, 32)), rtol=2**-7, atol=2e-2)
    k_tiles = -(-k // block_k)
    programs = -(-n // 16) * -(-m // cfg.block_m) * -(-k_tiles // -(-k_tiles // split))
    assert wait.calls == trigger.calls == programs
    interp.fp8_linear(x, q, s, (32, 32), act_quant=False, config=cfg)  # pdl off: no griddepcontrol at all
    assert wait.calls == programs


def test_act_fake_quant_pdl_interpreter(interp, monkeypatch):
    """The activation pass as a PDL launch: each program waits before it reads x and triggers once; the values do
    not change. Through fp8_linear with act_quant at M = 1, the pass and the gemv after it both wait."""
    g = torch.Generator().manual_seed(23)
    x = torch.randn(3, 200, generator=g).bfloat16()
    plain = interp.act_fake_quant(x, 32)
    assert torch.equal(interp.act_fake_quant(x, 32, pdl=True), plain)  # use_pdl is False here: a plain launch
    wait, trig = _GdcCounter(), _GdcCounter()
    monkeypatch.setattr(interp, "gdc_wait", wait)
    monkeypatch.setattr(interp, "gdc_launch_dependents", trig)
    monkeypatch.setattr(interp, "use_pdl", lambda requested, device, interpreted: requested)
    assert torch.equal(interp.act_fake_quant(x, 32, pdl=True), plain)
    assert wait.calls == trig.calls == 3  # 3 rows x one program of 256 columns each
    q, s = quant_fp8_block(torch.randn(24, 200, generator=g) / 16, (32, 32))
    cfg = interp.LinearConfig(1, 16, 64, 4, 1, 1, False, "gemv")
    want = interp.fp8_linear(x[:1], q, s, (32, 32), act_quant=True, config=cfg)
    wait.calls = trig.calls = 0
    assert torch.equal(interp.fp8_linear(x[:1], q, s, (32, 32), act_quant=True, config=cfg, pdl=True), want)
    assert wait.calls == trig.calls == 1 + 2  # the pass (one program) and the gemv (2 N tiles)


@pytest.mark.parametrize(("trigger", "want"), [("wait", 1), ("loop", 1), ("none", 0)])
def test_gemv_pdl_knobs_interpreter(interp, monkeypatch, trigger, want):
    """The PDL variant with its knobs (where the next kernel may launch; L2 prefetch of later K tiles, a PTX
    instruction the interpreter skips) gives the plain results; the trigger runs once per program unless "none"."""
    g = torch.Generator().manual_seed(17)
    q, s = quant_fp8_block(torch.randn(24, 256, generator=g) / 16, (32, 32))
    x = torch.randn(1, 256, generator=g).bfloat16()
    cfg = interp.LinearConfig(1, 16, 64, 4, 1, 2, False, "gemv")
    plain = interp.fp8_linear(x, q, s, (32, 32), act_quant=False, config=cfg)
    wait, trig = _GdcCounter(), _GdcCounter()
    monkeypatch.setattr(interp, "gdc_wait", wait)
    monkeypatch.setattr(interp, "gdc_launch_dependents", trig)
    monkeypatch.setattr(interp, "use_pdl", lambda requested, device, interpreted: requested)
    knobs = dataclasses.replace(cfg, pdl_trigger=trigger, pdl_l2_tiles=2)
    assert torch.equal(interp.fp8_linear(x, q, s, (32, 32), act_quant=False, config=knobs, pdl=True), plain)
    assert wait.calls == 4 and trig.calls == want * 4  # 2 N tiles x 2 splits
    with pytest.raises(ValueError, match="pdl_trigger"):
        interp.LinearConfig(1, 16, 64, 4, 1, 2, False, "gemv", pdl_trigger="early")
    with pytest.raises(ValueError, match="pdl_l2_tiles"):
        interp.LinearConfig(1, 16, 64, 4, 1, 2, False, "gemv", pdl_l2_tiles=-1)


def test_gemv_decode_is_exact(interp):
    """Every finite e4m3 code (subnormals, +-0, +-448) through the gemv decode equals torch's e4m3 -> fp32: a unit
    activation times a one-row weight holding each code once per column, unit scales."""
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # no NaN codes
    k = 256
    w = torch.zeros(len(codes), k, dtype=torch.uint8)
    w[:, 5] = codes
    q = w.view(torch.float8_e4m3fn)
    s = torch.full((-(-len(codes) // 32), k // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.zeros(1, k)
    x[0, 5] = 1.0
    cfg = interp.LinearConfig(1, 16, 64, 4, 1, 1, False, "gemv")
    got = interp.fp8_linear(x, q, s, (32, 32), act_quant=False, config=cfg)[0]
    assert torch.equal(got, codes.view(torch.float8_e4m3fn).float())


class _CountFills(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the torch ops that write a constant (zeros / fill_ / zero_) while active."""

    def __init__(self) -> None:
        super().__init__()
        self.fills = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if func.overloadpacket.__name__ in ("zeros", "fill_", "zero_", "full", "new_zeros"):
            self.fills += 1
        return func(*args, **(kwargs or {}))


def test_split_k_counters_are_left_zero_and_reused(interp):
    """Caller-owned counters: a split launch uses them (no zero fill of fresh counters), leaves them zero, and the
    result is bit-identical to the launch with fresh counters; fp8_linear, the grouped form and linear_f32_out."""
    from deepinfer_kernels.linear import split_k_counters

    g = torch.Generator().manual_seed(5)
    q, s = quant_fp8_block(torch.randn(40, 200, generator=g) / 15, (32, 32))
    x = torch.randn(3, 200, generator=g)
    cfg = interp.LinearConfig(16, 16, 32, 4, 1, 3)
    cnt = split_k_counters("cpu")
    assert cnt.dtype == torch.int32 and cnt.numel() >= 3 and not cnt.any()  # 3 N tiles x 1 M tile
    cnt = torch.zeros(16, dtype=torch.int32)  # forced splits of up to 8 tiles below: more than the CPU policy's 4
    fresh = interp.fp8_linear(x, q, s, (32, 32), act_quant=False, config=cfg)
    for _ in range(2):
        with _CountFills() as c:
            got = interp.fp8_linear(x, q, s, (32, 32), act_quant=False, config=cfg, counters=cnt)
        assert c.fills == 0 and torch.equal(got, fresh) and not cnt.any()
    gq, gs = quant_fp8_block(torch.randn(4 * 32, 64, generator=g) / 8, (32, 32))
    gx = torch.randn(2, 4, 64, generator=g)
    gcfg = interp.LinearConfig(16, 16, 32, 4, 1, 2)
    with _CountFills() as c:
        got = interp.fp8_linear_grouped(gx, gq, gs, (32, 32), act_quant=False, config=gcfg, counters=cnt)
    assert c.fills == 0 and not cnt.any()
    assert torch.equal(got, interp.fp8_linear_grouped(gx, gq, gs, (32, 32), act_quant=False, config=gcfg))
    w = torch.randn(50, 96, generator=g)
    with _CountFills() as c:
        got = interp.linear_f32_out(x[:, :96], w, config=interp.LinearConfig(16, 16, 32, 4, 1, 3), counters=cnt)
    assert c.fills == 0 and not cnt.any()
    assert torch.equal(got, interp.linear_f32_out(x[:, :96], w, config=interp.LinearConfig(16, 16, 32, 4, 1, 3)))
    # too few counters for the launch's tiles: fresh ones, the caller's untouched
    small = torch.zeros(1, dtype=torch.int32)
    assert torch.equal(interp.fp8_linear(x, q, s, (32, 32), act_quant=False, config=cfg, counters=small), fresh)
    assert not small.any()


def test_split_k_counters_validation():
    from deepinfer_kernels.linear import fp8_linear

    q, s = quant_fp8_block(torch.randn(32, 64), (32, 32))
    with pytest.raises(ValueError, match="counters"):
        fp8_linear(torch.randn(2, 64), q, s, (32, 32), counters=torch.zeros(4, dtype=torch.int64))


@pytest.mark.parametrize(("swap", "split"), [(False, 1), (True, 2)])
def test_fp8_linear_grouped_interpreter(interp, swap, split):
    """Block-diagonal weight in one launch (the grouped output projection): x [M, G, K] as a strided view, each
    16-row tile reads its own group's x; equal to the per-group reference up to fp32 summation order."""
    gen = torch.Generator().manual_seed(5)
    m, groups, rows, k, block = 3, 3, 32, 64, (32, 32)
    q, s = quant_fp8_block(torch.randn(groups * rows, k, generator=gen) / k**0.5, block)
    x = torch.randn(m, groups * k + 5, generator=gen)[:, 5:].view(m, groups, k)  # strided rows, unit K stride
    cfg = interp.LinearConfig(16, 16, 32, 4, 1, split, swap, "weight")
    for aq in (False, True):
        got = interp.fp8_linear_grouped(x, q, s, block, act_quant=aq, config=cfg).view(m, groups, rows)
        for g in range(groups):
            want = reference.fp8_linear(x[:, g], q[g * rows : (g + 1) * rows], s[g : g + 1], block, act_quant=aq)
            assert _rel(got[:, g], want) <= 1e-5, (aq, g)
    assert interp.fp8_linear_grouped(x, q, s, block, act_quant=False,
                                     config=interp.LinearConfig(16, 64, 32, 4, 1)) is None  # 64 does not divide 32


def test_linear_config_validation(interp):
    with pytest.raises(ValueError, match="power of two"):
        interp.LinearConfig(block_n=48)
    with pytest.raises(ValueError, match="below 16"):
        interp.LinearConfig(block_k=8)
    with pytest.raises(ValueError, match="below 16"):
        interp.LinearConfig(block_m=4)
    with pytest.raises(ValueError, match="mode"):
        interp.LinearConfig(mode="tf32")
    with pytest.raises(ValueError, match="split"):
        interp.LinearConfig(split=interp.MAX_SPLIT + 1)
    with pytest.raises(ValueError, match="prefetch"):
        interp.LinearConfig(mode="gemv", prefetch=3)
    with pytest.raises(ValueError, match="swap_ab"):
        interp.LinearConfig(mode="gemv", swap_ab=True)
    assert interp.LinearConfig(block_m=1, mode="gemv").block_m == 1
    # a programs target sets the split: 3 N tiles x ceil(10 / 3) = 4 splits of the 8 K tiles
    assert interp._split_count(interp.LinearConfig(16, 16, 32, programs=10), 3, 8, torch.device("cpu")) == 4
    assert interp._split_count(interp.LinearConfig(16, 16, 32, programs=10**4), 1, 256, torch.device("cpu")) == 64
    gq, gs = quant_fp8_block(torch.randn(16, 64), (32, 32))
    with pytest.raises(ValueError, match="gemv"):
        interp.linear_f32_out(torch.randn(1, 64), torch.randn(16, 64), config=interp.LinearConfig(mode="gemv"))
    assert interp.LinearConfig(block_m=4, mode="fma").block_m == 4
    q, s = quant_fp8_block(torch.randn(16, 256), (128, 128))
    with pytest.raises(ValueError, match="not a multiple of the scale block"):
        interp.fp8_linear(
            torch.randn(1, 256), q, s, (128, 128), act_quant=False, config=interp.LinearConfig(16, 16, 64)
        )


def test_linear_f32_out_interpreter(interp):
    g = torch.Generator().manual_seed(4)
    w = torch.randn(50, 72, generator=g).bfloat16()
    x = torch.randn(3, 72, generator=g).bfloat16()
    got = interp.linear_f32_out(x, w)
    assert got.dtype == torch.float32 and _rel(got, reference.linear_f32_out(x, w)) <= 1e-6
    assert interp.linear_f32_out(x[:0], w).shape == (0, 50)
    split = interp.linear_f32_out(x, w, config=interp.LinearConfig(16, 16, 32, 4, 1, 3))
    assert _rel(split, reference.linear_f32_out(x, w)) <= 1e-6
    for cfg in (None, interp.LinearConfig(16, 16, 32, 4, 1, 3)):  # written in place, split-K too
        buf = torch.full((5, 50), float("nan"))
        y = interp.linear_f32_out(x, w, config=cfg, out=buf[:3])
        assert y.data_ptr() == buf.data_ptr() and _rel(y, reference.linear_f32_out(x, w)) <= 1e-6
        assert torch.isnan(buf[3:]).all()
    with pytest.raises(ValueError, match="contiguous"):
        interp.linear_f32_out(x, w, out=torch.empty(50, 3).t())


# ---------------------------------------------------------------------------------------------- GPU, real shapes
V41 = [(1280, 5120), (32768, 1280), (5120, 8192), (2304, 5120), (5120, 2304)]


def _random_fp8(n: int, k: int, block: tuple[int, int], g: torch.Generator, device: str):
    w = torch.randint(-126, 127, (n, k), generator=g, dtype=torch.int8)
    w = torch.where((w & 0x7F) == 0x7F, torch.zeros_like(w), w)  # no NaN codes
    q = w.view(torch.float8_e4m3fn).to(device)
    sb = torch.randint(118, 124, (-(-n // block[0]), -(-k // block[1])), generator=g, dtype=torch.uint8)
    return q, sb.view(torch.float8_e8m0fnu).to(device)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 64, 256, 512, 2048])  # 512, 2048: the "dense" mode (prefill sizes)
@pytest.mark.parametrize("act_quant", [False, True])
def test_fp8_linear_gpu_v41_shapes(m, act_quant):
    from deepinfer_kernels.linear import fp8_linear

    g = torch.Generator().manual_seed(m)
    for n, k in V41 + [(1024, 4096)]:
        block = (128, 128) if (n, k) == (1024, 4096) else (32, 32)
        q, s = _random_fp8(n, k, block, g, "cuda")
        x = torch.randn(m, k, generator=g).cuda().bfloat16()
        got = fp8_linear(x, q, s, block, act_quant=act_quant, backend="triton")
        want = reference.fp8_linear(x.float(), q, s, block, act_quant=act_quant)
        assert got.dtype == torch.bfloat16 and _rel(got, want) <= 1e-2, (n, k)
        got32 = fp8_linear(x.float(), q, s, block, act_quant=act_quant, backend="triton")
        assert _rel(got32, want) <= 1e-5, (n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_lm_head_gpu(m):
    from deepinfer_kernels.linear import linear_f32_out

    g = torch.Generator(device="cuda").manual_seed(7)
    w = (torch.randn(129280, 5120, generator=g, device="cuda") / 70).bfloat16()
    x = torch.randn(m, 5120, generator=g, device="cuda").bfloat16()
    got = linear_f32_out(x, w, backend="triton")
    assert got.dtype == torch.float32 and _rel(got, reference.linear_f32_out(x, w)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_fp8_linear_gpu_split_k_is_deterministic(m):
    """Forced split-K at real shapes: 20 calls give identical bits; split vs unsplit within fp32 summation order."""
    from deepinfer_kernels.linear import triton as lt

    g = torch.Generator().manual_seed(11)
    for n, k in [(1280, 5120), (5120, 8192)]:
        q, s = _random_fp8(n, k, (32, 32), g, "cuda")
        x = torch.randn(m, k, generator=g).cuda()
        bm = 16 if m <= 16 else 64
        split, one = lt.LinearConfig(bm, 64, 128, 4, 4, 8, m <= 16), lt.LinearConfig(bm, 64, 128, 4, 4, 1)
        for xx in (x.bfloat16(), x):
            first = lt.fp8_linear(xx, q, s, (32, 32), act_quant=False, config=split)
            for _ in range(19):
                assert torch.equal(first, lt.fp8_linear(xx, q, s, (32, 32), act_quant=False, config=split))
            want = reference.fp8_linear(x, q, s, (32, 32))
            tol = 1e-2 if xx.dtype == torch.bfloat16 else 1e-5
            assert _rel(first, want) <= tol, (n, k, xx.dtype)
            assert _rel(first, lt.fp8_linear(xx, q, s, (32, 32), act_quant=False, config=one)) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_fp8_linear_gpu_split_k_counters_reused(m):
    """Default split policy at V4.1 decode shapes with one counter buffer shared by every call (as a model layer
    does), eager and replayed in a CUDA graph: bit-identical to fresh counters, the buffer zero after each call, and
    the captured graph holds no fill kernel for them."""
    from deepinfer_kernels.linear import fp8_linear, linear_f32_out, split_k_counters

    g = torch.Generator().manual_seed(17)
    cnt = split_k_counters("cuda")
    for n, k in [(1024, 4096), (512, 4096), (4096, 1024), (384, 4096)]:
        q, s = _random_fp8(n, k, (32, 32), g, "cuda")
        x = torch.randn(m, k, generator=g).cuda().bfloat16()
        fresh = fp8_linear(x, q, s, (32, 32), backend="triton")
        for _ in range(3):
            assert torch.equal(fp8_linear(x, q, s, (32, 32), backend="triton", counters=cnt), fresh), (n, k)
            torch.cuda.synchronize()
            assert not cnt.any()
        w = (torch.randn(n, k, generator=g) / 64).cuda().bfloat16()
        f32 = linear_f32_out(x, w, backend="triton")
        assert torch.equal(linear_f32_out(x, w, backend="triton", counters=cnt), f32) and not cnt.any()
        graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = fp8_linear(x, q, s, (32, 32), backend="triton", counters=cnt)  # warm-up (compiles)
            with torch.cuda.graph(graph, stream=stream):
                out = fp8_linear(x, q, s, (32, 32), backend="triton", counters=cnt)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(5):
            out.zero_()
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, fresh) and not cnt.any(), (n, k)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 64])
def test_fp8_linear_grouped_gpu_v41_wo_a(m):
    """wo_a of V4.1 (8 groups of 1024 rows over 4096 inputs each) in one launch == per-group fp8_linear."""
    from deepinfer_kernels.linear import fp8_linear, fp8_linear_grouped

    g = torch.Generator().manual_seed(13)
    q, s = _random_fp8(8 * 1024, 4096, (32, 32), g, "cuda")
    o = torch.randn(m, 8, 4096, generator=g).cuda().bfloat16()
    for aq in (False, True):
        got = fp8_linear_grouped(o, q, s, (32, 32), act_quant=aq, backend="triton")
        for i in range(8):
            want = reference.fp8_linear(o[:, i].float(), q[i * 1024 : (i + 1) * 1024], s[i * 32 : (i + 1) * 32],
                                        (32, 32), act_quant=aq)  # fmt: skip
            assert _rel(got[:, i], want) <= 1e-2, (aq, i)
            one = fp8_linear(o[:, i], q[i * 1024 : (i + 1) * 1024], s[i * 32 : (i + 1) * 32], (32, 32), act_quant=aq,
                             backend="triton")  # fmt: skip
            assert _rel(got[:, i], one) <= 1e-2, (aq, i)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 64])
def test_fp8_linear_gpu_gemv_v41_shapes(m):
    """"gemv" (PTX decode and loads) at V4.1 shapes and the V4 128 x 128 blocks: bf16 (act_quant off / on) <= 1e-2
    and fp32 / fp16 <= 1e-5 / 1e-2 of max |ref|, with a programs-target split and a forced split of up to 64
    (bit-identical over 5 calls, the caller's counters left zero), each prefetch depth."""
    from deepinfer_kernels.linear import triton as lt

    g = torch.Generator().manual_seed(21 + m)
    cnt = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
    bm = min(16, 1 << (m - 1).bit_length())
    for n, k in V41 + [(512, 5120), (1024, 4096)]:
        block = (128, 128) if (n, k) == (1024, 4096) else (32, 32)
        q, s = _random_fp8(n, k, block, g, "cuda")
        x = torch.randn(m, k, generator=g).cuda()
        forced = min(64, k // 128)
        cfgs = [lt.LinearConfig(bm, 16, 512, 4, 1, 0, False, "gemv", programs=264, prefetch=2),
                lt.LinearConfig(bm, 32, 128, 4, 1, forced, False, "gemv", prefetch=1),
                lt.LinearConfig(bm, 16, 256, 8, 1, 1, False, "gemv", prefetch=0)]  # fmt: skip
        xb = x.bfloat16()
        for cfg in cfgs:
            for aq in (False, True):
                # the reference quantizes the same bf16 values: quantizing fp32 x instead moves ~2% of max |y|
                # (bf16 rounding pushes values across e4m3 rounding midpoints), whatever the kernel
                want = reference.fp8_linear(xb.float(), q, s, block, act_quant=aq)
                got = lt.fp8_linear(xb, q, s, block, act_quant=aq, config=cfg, counters=cnt)
                assert got.dtype == torch.bfloat16 and _rel(got, want) <= 1e-2, (n, k, cfg, aq)
                for _ in range(4):
                    again = lt.fp8_linear(x.bfloat16(), q, s, block, act_quant=aq, config=cfg, counters=cnt)
                    assert torch.equal(got, again), (n, k, cfg, aq)
                torch.cuda.synchronize()
                assert not cnt.any()
            want = reference.fp8_linear(x, q, s, block)
            assert _rel(lt.fp8_linear(x, q, s, block, act_quant=False, config=cfg), want) <= 1e-5, (n, k, cfg)
            got16 = lt.fp8_linear(x.half(), q, s, block, act_quant=False, config=cfg)
            assert _rel(got16, reference.fp8_linear(x.half(), q, s, block)) <= 1e-2, (n, k, cfg)


@pytest.mark.gpu
def test_gemv_decode_is_exact_gpu():
    """Every finite e4m3 code through the PTX decode equals torch's e4m3 -> fp32 (see test_gemv_decode_is_exact)."""
    from deepinfer_kernels.linear import triton as lt

    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)
    k = 256
    w = torch.zeros(len(codes), k, dtype=torch.uint8)
    w[:, 5] = codes
    s = torch.full((-(-len(codes) // 32), k // 32), 127, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    x = torch.zeros(1, k)
    x[0, 5] = 1.0
    for dt in (torch.float32, torch.bfloat16):
        got = lt.fp8_linear(x.to(dt).cuda(), w.view(torch.float8_e4m3fn).cuda(), s.cuda(), (32, 32), act_quant=False,
                            config=lt.LinearConfig(1, 16, 64, 4, 1, 1, False, "gemv"))[0].cpu()  # fmt: skip
        assert torch.equal(got, codes.view(torch.float8_e4m3fn).float().to(dt)), dt


@pytest.mark.gpu
def test_fp8_linear_gpu_gemv_pdl_chain_is_bit_identical():
    """A chain of M = 1 gemv launches at V4.1 shapes (each reading the previous output, split-K counters shared,
    some after the activation pass), eager and captured in a CUDA graph, with pdl on equals pdl off bit for bit (a missing or misplaced wait would
    let a launch read a stale input or overwrite one still being read). On a device without PDL both are plain."""
    from deepinfer_kernels.linear import fp8_linear, split_k_counters
    from deepinfer_kernels.linear import triton as lt

    g = torch.Generator().manual_seed(5)
    shapes = [(1280, 5120), (5120, 1280), (2304, 5120), (5120, 2304), (32768, 5120), (5120, 32768)]
    ws = [_random_fp8(n, k, (32, 32), g, "cuda") for n, k in shapes]
    cnt = split_k_counters("cuda")
    x = torch.randn(1, 5120, generator=g).cuda().bfloat16()
    split = lt.LinearConfig(1, 16, 512, 4, 1, 8, False, "gemv")  # the last launch split-K: counters, workspace

    def chain(pdl: bool) -> list[torch.Tensor]:
        outs, h = [], x
        for i, (q, s) in enumerate(ws):
            if i == len(ws) - 1:
                h = lt.fp8_linear(h, q, s, (32, 32), act_quant=False, config=split, counters=cnt, pdl=pdl)
            else:  # every other launch quantizes its activations first: the activation pass is a PDL launch too
                h = fp8_linear(h, q, s, (32, 32), act_quant=i % 2 == 1, backend="triton", counters=cnt, pdl=pdl)
            outs.append(h)
        return outs

    eager_off, eager_on = chain(False), chain(True)
    assert torch.isfinite(eager_off[-1].float()).all()  # ~70x growth per launch stays far inside bf16's range
    for a, b in zip(eager_on, eager_off, strict=True):
        assert torch.equal(a, b)
    graphs = {}
    for pdl in (False, True):
        chain(pdl)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = chain(pdl)
        graphs[pdl] = (graph, outs)
    for _ in range(3):
        graphs[True][0].replay()
        graphs[False][0].replay()
        torch.cuda.synchronize()
        for a, b, e in zip(graphs[True][1], graphs[False][1], eager_off, strict=True):
            assert torch.equal(a, b) and torch.equal(b, e)
    assert not cnt.any()
