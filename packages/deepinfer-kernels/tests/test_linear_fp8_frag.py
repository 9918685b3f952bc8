"""The "frag" FP8 linear (`deepinfer_kernels.linear.fp8_frag.triton`): codes decoded into the wgmma register operand, the
activations permuted into the same dot order.

CPU interpreter: the portable decode ("bits": integer decode to fp32, fp32 dots) runs the same tiling, K order and
scale indexing as the GPU's PTX decode, so it checks the permutation, the scale words (32, 64 and 128-column
blocks), row / token tails, split-K and the block-diagonal form against the torch reference (fp32: 1e-5 of max
|ref|, only the summation order differs). `gpu`: the PTX decode at V4.1 shapes (bf16 output: 1e-2 of max |ref|, as
the other modes), every code and scale code exact, and the fast decode's redo of tiles with large scale codes.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.linear import reference
from deepinfer_kernels.quant import quant_fp8_block
from kernels_testing import LINEAR_MODULES, triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter(*LINEAR_MODULES) as (*_, frag, lt):
        yield frag, lt


def test_permute_columns_is_the_fragment_order():
    """Position 16s + 8h + 2q + j holds column 16s + 4q + 2h + j: lane q of a quad gets its word's bytes 0, 1 at
    dot positions 2q, 2q + 1 and bytes 2, 3 at 2q + 8, 2q + 9 (the wgmma A fragment), for every 16-column step."""
    from deepinfer_kernels.linear.fp8_frag.triton import permute_columns

    x = torch.arange(2 * 3 * 64).reshape(2, 3, 64)
    got = permute_columns(x)
    for p in range(64):
        s, h, q, j = p // 16, (p // 8) % 2, (p // 2) % 4, p % 2
        assert torch.equal(got[..., p], x[..., 16 * s + 4 * q + 2 * h + j]), p
    assert got.is_contiguous() and sorted(got[0, 0].tolist()) == x[0, 0].tolist()


@pytest.mark.parametrize(
    ("m", "n", "k", "block", "block_m", "block_k", "split"),
    [
        (3, 64, 128, (32, 32), 16, 128, 1),
        (17, 100, 384, (32, 32), 16, 128, 2),  # row tail (100 = 64 + 36), token tail, 2 splits of 3 K tiles
        (5, 70, 512, (128, 128), 16, 128, 3),  # V4 blocks: one scale byte per chunk, ragged last split
        (4, 64, 512, (64, 64), 16, 256, 1),  # 64-column scale blocks, two chunks per K step
        (40, 128, 256, (32, 32), 32, 128, 2),  # two token tiles
    ],
)
def test_frag_interpreter_equals_the_reference(interp, m, n, k, block, block_m, block_k, split):
    """fp32 activations through the portable decode, act_quant off and on: 1e-5 of max |ref| (the same products,
    another summation order); split-K bit-identical across calls, the caller's counters left zero."""
    _, lt = interp
    g = torch.Generator().manual_seed(k + n)
    q, s = quant_fp8_block(torch.randn(n, k, generator=g) / k**0.5, block)
    x = torch.randn(m, k, generator=g)
    cfg = lt.LinearConfig(block_m, 64, block_k, 4, 1, split, False, "frag")
    cnt = torch.zeros(64, dtype=torch.int32)
    for aq in (False, True):
        got = lt.fp8_linear(x, q, s, block, act_quant=aq, config=cfg, counters=cnt)
        assert _rel(got, reference.fp8_linear(x, q, s, block, act_quant=aq)) <= 1e-5, aq
        assert not cnt.any()
        assert torch.equal(got, lt.fp8_linear(x, q, s, block, act_quant=aq, config=cfg, counters=cnt)), aq


def test_frag_interpreter_grouped(interp):
    """The block-diagonal form (the grouped output projection) with x a strided [M, G, K] view: each 64-row tile
    reads its own group's activations."""
    _, lt = interp
    gen = torch.Generator().manual_seed(5)
    m, groups, rows, k, block = 3, 3, 64, 128, (32, 32)
    q, s = quant_fp8_block(torch.randn(groups * rows, k, generator=gen) / k**0.5, block)
    x = torch.randn(m, groups * k + 8, generator=gen)[:, 8:].view(m, groups, k)
    cfg = lt.LinearConfig(16, 64, 128, 4, 1, 1, False, "frag")
    got = lt.fp8_linear_grouped(x, q, s, block, act_quant=False, config=cfg).view(m, groups, rows)
    for i in range(groups):
        want = reference.fp8_linear(x[:, i], q[i * rows : (i + 1) * rows], s[2 * i : 2 * i + 2], block)
        assert _rel(got[:, i], want) <= 1e-5, i


def test_frag_interpreter_decode_is_exact(interp):
    """Every finite e4m3 code times scale codes from 0 to 200 through the portable decode equals torch's decode: a
    unit activation picks one column, so the output is the decoded weight itself."""
    _, lt = interp
    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # no NaN codes
    n, k = 256, 128
    w = torch.zeros(n, k, dtype=torch.uint8)
    w[: len(codes), 37] = codes
    for sc in (0, 1, 100, 127, 134, 135, 200):  # 448 * 2^(sc - 127) stays finite in fp32
        s = torch.full((n // 32, k // 32), sc, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        x = torch.zeros(1, k)
        x[0, 37] = 1.0
        got = lt.fp8_linear(x, w.view(torch.float8_e4m3fn), s, (32, 32), act_quant=False,
                            config=lt.LinearConfig(16, 64, 128, 4, 1, 1, False, "frag"))[0, : len(codes)]  # fmt: skip
        want = codes.view(torch.float8_e4m3fn).float() * s.float()[0, 0]
        assert torch.equal(got, want), sc


def test_frag_operands_it_does_not_take(interp):
    """An explicit "frag" config with operands the kernel cannot read raises with the reason; the default config
    takes "frag" for bf16 activations at 17..256 tokens (from 8 for weights of 32M elements or more) and keeps the
    other modes otherwise."""
    frag, lt = interp
    g = torch.Generator().manual_seed(1)
    q, s = quant_fp8_block(torch.randn(64, 160, generator=g), (32, 32))
    cfg = lt.LinearConfig(16, 64, 128, 4, 1, 1, False, "frag")
    with pytest.raises(ValueError, match="multiple of the config's block_k"):
        lt.fp8_linear(torch.randn(2, 160), q, s, (32, 32), act_quant=False, config=cfg)
    q, s = quant_fp8_block(torch.randn(64, 128, generator=g), (32, 32))
    with pytest.raises(ValueError, match="UE8M0"):
        lt.fp8_linear(torch.randn(2, 128), q, s.float(), (32, 32), act_quant=False, config=cfg)
    assert frag.unsupported(torch.randn(2, 128).half(), q, s, (32, 32), 128) is not None  # fp16 activations
    assert frag.unsupported(torch.randn(2, 128).bfloat16(), q, s, (32, 32), 128) is None
    # fp32 activations only under the interpreter: the GPU decode would round them to bf16 without a word
    assert frag.unsupported(torch.empty(2, 128, device="meta"), q, s, (32, 32), 128) is not None
    assert frag.unsupported(torch.randn(2, 128), q, s, (32, 32), 128) is None
    with pytest.raises(ValueError, match="block_n >= 64"):
        lt.LinearConfig(16, 32, 128, mode="frag")
    with pytest.raises(ValueError, match="block_k a multiple of 128"):
        lt.LinearConfig(16, 64, 64, mode="frag")
    with pytest.raises(ValueError, match="swap_ab"):
        lt.LinearConfig(16, 64, 128, mode="frag", swap_ab=True)
    for m, n, dtype, mode in ((64, 4096, torch.bfloat16, "frag"), (17, 4096, torch.bfloat16, "frag"),
                              (256, 4096, torch.bfloat16, "frag"), (16, 4096, torch.bfloat16, "weight"),
                              (8, 8192, torch.bfloat16, "frag"), (4, 8192, torch.bfloat16, "weight"),
                              (64, 4096, torch.float16, "weight"), (1, 4096, torch.bfloat16, "gemv"),
                              (512, 4096, torch.bfloat16, "dense")):  # fmt: skip
        assert lt.default_config(m, n, 5120, 32, dtype).mode == mode, (m, n, dtype)
    assert lt.default_config(64, 32768, 1280, 32, torch.bfloat16).block_n == 128  # very tall weights
    assert lt.default_config(256, 32768, 1280, 32, torch.bfloat16).block_n == 64


# ---------------------------------------------------------------------------------------------- GPU, real shapes
V41 = [(1280, 5120), (32768, 1280), (5120, 8192), (2304, 5120), (5120, 2304), (512, 5120), (25600, 6144)]


def _random_fp8(n: int, k: int, block: tuple[int, int], g: torch.Generator, lo: int = 118, hi: int = 124):
    w = torch.randint(-126, 127, (n, k), generator=g, dtype=torch.int8)
    w = torch.where((w & 0x7F) == 0x7F, torch.zeros_like(w), w)  # no NaN codes
    sb = torch.randint(lo, hi, (-(-n // block[0]), -(-k // block[1])), generator=g, dtype=torch.uint8)
    return w.view(torch.float8_e4m3fn).cuda(), sb.view(torch.float8_e8m0fnu).cuda()


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 17, 64, 256])
def test_frag_gpu_v41_shapes(m):
    """PTX decode at the V4.1 FP8 shapes (and V4's 128 x 128 blocks), fast and exact decode, the default split and
    a forced one, act_quant off and on: bf16 <= 1e-2 of max |ref|; a forced split bit-identical over 3 calls with
    the caller's counters left zero; fast == exact bit for bit (same products, same order)."""
    from deepinfer_kernels.linear import triton as lt

    g = torch.Generator().manual_seed(40 + m)
    cnt = torch.zeros(1 << 14, dtype=torch.int32, device="cuda")
    bm = min(64, max(16, 1 << (m - 1).bit_length()))
    for n, k in V41 + [(1024, 4096)]:
        block = (128, 128) if (n, k) == (1024, 4096) else (32, 32)
        q, s = _random_fp8(n, k, block, g)
        x = torch.randn(m, k, generator=g).cuda().bfloat16()
        for aq in (False, True):
            want = reference.fp8_linear(x.float(), q, s, block, act_quant=aq)
            outs = []
            for exact in (False, True):
                for split in (0, min(8, k // 128)):
                    cfg = lt.LinearConfig(bm, 64, 128, 4, 3, split, False, "frag", exact_decode=exact)
                    got = lt.fp8_linear(x, q, s, block, act_quant=aq, config=cfg, counters=cnt)
                    assert got.dtype == torch.bfloat16 and _rel(got, want) <= 1e-2, (n, k, cfg, aq)
                    if split:
                        for _ in range(2):
                            again = lt.fp8_linear(x, q, s, block, act_quant=aq, config=cfg, counters=cnt)
                            assert torch.equal(got, again), (n, k, cfg, aq)
                        outs.append(got)
            assert torch.equal(outs[0], outs[1]), (n, k, aq)  # fast == exact
            torch.cuda.synchronize()
            assert not cnt.any()
            if (n, k) == (5120, 8192):  # the default config picks frag here and matches
                got = lt.fp8_linear(x, q, s, block, act_quant=aq, counters=cnt)
                assert _rel(got, want) <= 1e-2, (n, k, aq)


@pytest.mark.gpu
def test_frag_gpu_grouped_wo_a():
    """The grouped output projection (8 groups of [1024 x 4096], x a strided [M, 8, 4096] view) at M = 64."""
    from deepinfer_kernels.linear import fp8_linear, fp8_linear_grouped

    g = torch.Generator().manual_seed(11)
    q, s = _random_fp8(8 * 1024, 4096, (32, 32), g)
    o = torch.randn(64, 8 * 4096 + 64, generator=g).cuda().bfloat16()[:, 64:].view(64, 8, 4096)
    got = fp8_linear_grouped(o, q, s, (32, 32), backend="triton")
    for i in range(8):
        one = fp8_linear(o[:, i], q[i * 1024 : (i + 1) * 1024], s[i * 32 : (i + 1) * 32], (32, 32), backend="triton")
        want = reference.fp8_linear(o[:, i].float(), q[i * 1024 : (i + 1) * 1024], s[i * 32 : (i + 1) * 32], (32, 32))
        assert _rel(got[:, i], want) <= 1e-2 and _rel(one, want) <= 1e-2, i


@pytest.mark.gpu
def test_frag_gpu_decode_is_exact_for_every_code():
    """Every finite e4m3 code times scale codes 0..250 through the PTX decode equals torch's decode rounded to
    bf16: the fast decode for codes <= 134, its exact redo of the tile above (an infinite multiplier otherwise), and
    the exact decode throughout."""
    from deepinfer_kernels.linear import triton as lt

    codes = torch.arange(256, dtype=torch.int32)
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)
    n, k = 256, 128
    w = torch.zeros(n, k, dtype=torch.uint8)
    w[: len(codes), 37] = codes
    x = torch.zeros(16, k, dtype=torch.bfloat16)
    x[:, 37] = 1.0
    for sc in (0, 1, 60, 100, 127, 134, 135, 160, 200, 250):
        s = torch.full((n // 32, k // 32), sc, dtype=torch.uint8).view(torch.float8_e8m0fnu)
        want = (codes.view(torch.float8_e4m3fn).float() * s.float()[0, 0]).bfloat16()
        for exact in (False, True):
            cfg = lt.LinearConfig(16, 64, 128, 4, 3, 1, False, "frag", exact_decode=exact)
            got = lt.fp8_linear(x.cuda(), w.view(torch.float8_e4m3fn).cuda(), s.cuda(), (32, 32), act_quant=False,
                                config=cfg).cpu()  # fmt: skip
            assert torch.equal(got[0, : len(codes)], want), (sc, exact)
            assert torch.equal(got[-1, : len(codes)], want), (sc, exact)
