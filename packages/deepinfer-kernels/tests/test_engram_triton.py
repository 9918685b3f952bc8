"""Triton Engram kernels vs the torch references: ring_step and hash_rows (exact, integer ops), engram_inject.

Tolerance: the gate's sums run in another order (fp32, ~1e-6 relative), so fp32 outputs agree to atol 1e-5 /
rtol 1e-5 and bf16 outputs to 1 ULP (rtol 2^-7; the interpreter truncates instead of rounding). Covered: d not
a multiple of the block (two passes of several blocks), image rows (gate 0: the streams unchanged, bit for
bit), a zero dot (copysign keeps +0 / -0), strided keys / value views of one projection output, empty batches.
lookup_rows (FP8 table rows): bit-exact in fp32 for every e4m3 code (NaN included) and a range of scale codes;
bf16 out 1 ULP (the interpreter truncates).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from deepinfer_kernels.engram import engram_inject, hash_rows, lookup_rows, reference, ring_step
from kernels_testing import triton_interpreter

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-6, 2.0**-7)}


@pytest.fixture(scope="module")
def interp():
    with triton_interpreter("deepinfer_kernels.engram.triton") as (mod,):
        yield mod


def _inputs(t: int, n: int, d: int, dtype: torch.dtype, device: str = "cpu"):
    g = torch.Generator().manual_seed(t * 100 + d)
    r = torch.randn(t, n, d, generator=g).to(dtype)
    kv = torch.randn(t, n + 1, d, generator=g).to(dtype)  # one projection: keys of the n streams, then the value
    qw = (1 + 0.1 * torch.randn(n, d, generator=g)).to(dtype)
    kw = (1 + 0.1 * torch.randn(n, d, generator=g)).to(dtype)
    mask = torch.zeros(t, dtype=torch.bool)
    mask[::3] = True
    return [x.to(device) for x in (r, kv[:, :n], kv[:, n], qw, kw, mask)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape", [(1, 4, 64), (5, 4, 2500), (3, 2, 40), (4, 1, 16)], ids=str)
@pytest.mark.parametrize("masked", [False, True], ids=["text", "image"])
def test_interpreter_matches_reference(interp, shape, dtype, masked):
    r, keys, val, qw, kw, mask = _inputs(*shape, dtype)
    m = mask if masked else None
    out = interp.engram_inject(r, keys, val, qw, kw, 1e-6, m)
    ref = reference.engram_inject(r, keys, val, qw, kw, 1e-6, m)
    atol, rtol = _TOL[dtype]
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)
    if masked:
        assert torch.equal(out[mask], r[mask])


def test_interpreter_zero_dot_sign_and_empty(interp):
    r = torch.tensor([[[1.0, -1.0, 0.0, 0.0]], [[-1.0, 1.0, 0.0, 0.0]]])  # dot 0 with +0 / -0 sums
    keys = torch.tensor([[[1.0, 1.0, 0.0, 0.0]], [[1.0, 1.0, 0.0, 0.0]]])
    val = torch.ones(2, 4)
    w = torch.ones(1, 4)
    out = interp.engram_inject(r, keys, val, w, w, 1e-20)
    torch.testing.assert_close(out, reference.engram_inject(r, keys, val, w, w, 1e-20), atol=1e-6, rtol=1e-6)
    z = torch.zeros(0, 4, 8)
    assert interp.engram_inject(z, z, torch.zeros(0, 8), torch.ones(4, 8), torch.ones(4, 8), 1e-6).shape == z.shape


def test_dispatcher(interp):
    r, keys, val, qw, kw, mask = _inputs(3, 4, 48, torch.float32)
    got = engram_inject(r, keys, val, qw, kw, 1e-6, mask, backend="triton")
    torch.testing.assert_close(got, reference.engram_inject(r, keys, val, qw, kw, 1e-6, mask), atol=1e-5, rtol=1e-5)
    r3, k3 = torch.randn(2, 3, 8), torch.randn(2, 3, 8)  # n = 3: no kernel, the reference
    w3 = torch.ones(3, 8)
    torch.testing.assert_close(engram_inject(r3, k3, torch.ones(2, 8), w3, w3, 1e-6),
                               reference.engram_inject(r3, k3, torch.ones(2, 8), w3, w3, 1e-6))
    with pytest.raises(ValueError, match="engram_inject: expected"):
        engram_inject(r, keys[:, :2], val, qw, kw, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_gpu_matches_reference(t, dtype):
    r, keys, val, qw, kw, mask = _inputs(t, 4, 5120, dtype, "cuda")
    out = engram_inject(r, keys, val, qw, kw, 1e-6, mask, backend="triton")
    ref = reference.engram_inject(r, keys, val, qw, kw, 1e-6, mask)
    atol, rtol = _TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=rtol)


# ------------------------------------------------------------------------------------------------ hash_rows
def _hash_case(t: int, n_layers: int, k: int, heads: int, seed: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    c = 50
    cid_table = torch.randint(0, 1 << 20, (c,), generator=g)
    cid_table[torch.randint(0, c, (6,), generator=g)] = -1  # DEAD ids (and entry 0 = id -1)
    cid_table[0] = -1
    ids = torch.randint(0, c - 1, (t,), generator=g)
    prev = torch.randint(-1, c - 1, (t, k), generator=g)
    mult = torch.randint(0, 1 << 30, (n_layers, k + 1), generator=g)
    primes = torch.randint(2, 100000, (n_layers, k, heads), generator=g)
    offsets = torch.randint(0, 1 << 20, (n_layers, k, heads), generator=g)
    return [x.to(device) for x in (ids, prev, cid_table, mult, primes, offsets)]


@pytest.mark.parametrize("shape", [(9, 2, 3, 2), (1, 1, 3, 8), (5, 3, 1, 3), (4, 2, 5, 1)], ids=str)
def test_hash_rows_interpreter_equals_reference(interp, shape):
    t, n_layers, k, heads = shape
    case = _hash_case(t, n_layers, k, heads, seed=sum(shape))
    want = reference.hash_rows(*case, pad_cid=7)
    assert want.shape == (t, n_layers, k * heads)
    assert torch.equal(interp.hash_rows(*case, pad_cid=7), want)
    assert torch.equal(hash_rows(*case, pad_cid=7, backend="triton"), want)


def test_hash_rows_dead_rule_and_empty(interp):
    ids, prev, cid_table, mult, primes, offsets = _hash_case(3, 1, 3, 1, seed=4)
    prev[0] = -1  # no predecessor: every n-gram of token 0 hashes its own id with pads
    prev[1, 0] = 0  # id 0: compressed id of entry 1, made DEAD below -> blocks s >= 1
    cid_table[1] = -1
    ids[1] = ids[0] = 5
    cid_table[6] = 12345  # a live compressed id for both tokens
    case = (ids, prev, cid_table, mult, primes, offsets)
    want = reference.hash_rows(*case, pad_cid=3)
    assert torch.equal(interp.hash_rows(*case, pad_cid=3), want)
    assert torch.equal(want[0], want[1])  # both hash [own id, pad, pad, pad]: blocked by -1 and by a DEAD id
    empty = interp.hash_rows(ids[:0], prev[:0], cid_table, mult, primes, offsets, 3)
    assert empty.shape == (0, 1, 3)
    with pytest.raises(ValueError, match="hash_rows: expected"):
        hash_rows(ids, prev[:, :2], cid_table, mult, primes, offsets, 3)


@pytest.mark.gpu
def test_gpu_hash_rows_equals_reference():
    case = _hash_case(64, 2, 3, 8, seed=11, device="cuda")
    assert torch.equal(hash_rows(*case, pad_cid=5, backend="triton"), reference.hash_rows(*case, pad_cid=5))


# ------------------------------------------------------------------------------------------------ ring_step
def _ring_case(device: str = "cpu"):
    """Ring of 3 slots x R = 6 (slot 2 = dump); seq 0 in slot 1 resumes at 4 with 3 tokens (ring and in-step
    predecessors), seq 1 in slot 0 starts at 0 with 8 tokens (more than R: its first 2 writes go to the dump slot,
    predecessors before position 0 are -1), seq 2 decodes one token at 9 in the dump slot, as a padding row does."""
    g = torch.Generator().manual_seed(0)
    ring = torch.randint(-1, 100, (3, 6), generator=g)
    qlen = torch.tensor([3, 8, 1])
    ctx = torch.tensor([4, 0, 9])
    slot = torch.tensor([1, 0, 2])
    seq = torch.repeat_interleave(torch.arange(3), qlen)
    pos = torch.cat([torch.arange(c, c + n) for c, n in zip(ctx.tolist(), qlen.tolist())])
    ids = torch.randint(0, 1000, (int(qlen.sum()),), generator=g)
    return [x.to(device) for x in (ring, ids, pos, seq, ctx, qlen, slot)]


@pytest.mark.parametrize("back", [3, 1, 0])
def test_ring_step_interpreter_equals_reference(interp, back):
    ring, *step = _ring_case()
    want_ring = ring.clone()
    want = reference.ring_step(want_ring, *step, back, 2)
    got_ring = ring.clone()
    got = interp.ring_step(got_ring, *step, back, 2)
    assert got.shape == (step[0].shape[0], back) and torch.equal(got, want)
    assert torch.equal(got_ring[:2], want_ring[:2])  # the dump slot's cells may take any of their writes
    got2 = ring_step(ring.clone(), *step, back=back, dump_slot=2, backend="triton")
    assert torch.equal(got2, want)


@pytest.mark.gpu
def test_gpu_ring_step_equals_reference():
    ring, *step = _ring_case("cuda")
    want_ring, got_ring = ring.clone(), ring.clone()
    want = reference.ring_step(want_ring, *step, 3, 2)
    assert torch.equal(ring_step(got_ring, *step, back=3, dump_slot=2, backend="triton"), want)
    assert torch.equal(got_ring[:2], want_ring[:2])


def _fp8_table(n: int, d: int, group: int, seed: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, d), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[0, :256 if d >= 256 else d] = torch.arange(256, dtype=torch.int32)[: min(d, 256)].to(torch.uint8)
    scale = torch.randint(100, 140, (n, -(-d // group)), generator=g, dtype=torch.int32).to(torch.uint8)
    scale[0, 0] = 1  # tiny scale: results near the fp32 subnormal range
    return codes.view(torch.float8_e4m3fn).to(device), scale.view(torch.float8_e8m0fnu).to(device)


@pytest.mark.parametrize("d,group", [(256, 32), (64, 8), (96, 32), (16, 32), (40, 32)], ids=str)  # D < group, ragged
def test_lookup_rows_interpreter_equals_reference(interp, d, group):
    w, s = _fp8_table(7, d, group, seed=d)
    ids = torch.tensor([[0, 3, 6], [2, 0, 5]])
    want = reference.lookup_rows(w, s, ids, group, torch.float32)
    got = interp.lookup_rows(w, s, ids, group, torch.float32)
    assert got.shape == (2, 3, d) and torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())
    gb = interp.lookup_rows(w, s, ids, group, torch.bfloat16)
    wb = reference.lookup_rows(w, s, ids, group, torch.bfloat16)
    # bf16 subnormals of the tiny-scale row: the interpreter flushes / truncates them (atol below 1e-37)
    torch.testing.assert_close(gb.float().nan_to_num(), wb.float().nan_to_num(), atol=1e-37, rtol=2.0**-7)
    assert interp.lookup_rows(w, s, ids[:0], group, torch.float32).shape == (0, 3, d)


def test_lookup_rows_dispatcher(interp):
    w, s = _fp8_table(4, 64, 32, seed=1)
    ids = torch.tensor([3, 1])
    want = reference.lookup_rows(w, s, ids, 32, torch.float32)
    assert torch.equal(lookup_rows(w, s, ids, 32, torch.float32, backend="triton").nan_to_num(), want.nan_to_num())
    with pytest.raises(ValueError, match="lookup_rows"):
        lookup_rows(w, s[:, :1], ids, 32, torch.float32)


@pytest.mark.gpu
def test_gpu_lookup_rows_equals_reference():
    # V4.1 Engram table rows: head_dim 256 (assumed here), UE8M0 per 32 columns, 3 lookups of 8 tokens
    w, s = _fp8_table(1000, 256, 32, seed=2, device="cuda")
    ids = torch.randint(0, 1000, (8, 3), device="cuda")
    ids[0, 0] = 0  # the row holding every e4m3 code
    for dtype in (torch.float32, torch.bfloat16):
        got = lookup_rows(w, s, ids, 32, dtype, backend="triton")
        want = reference.lookup_rows(w, s, ids, 32, dtype)
        # exact, but for results below the fp32 normal range (row 0's tiny scale), should the GPU flush them
        torch.testing.assert_close(got, want, atol=1e-37, rtol=0, equal_nan=True)
