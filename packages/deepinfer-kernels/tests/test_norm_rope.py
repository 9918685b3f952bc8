"""norm_rope references against hand-derived values (docs/model.md §2)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from deepinfer_kernels.norm_rope import apply_rope, rms_norm, rope_cos_sin, rope_freqs, yarn_correction_range


def test_rms_norm_hand_case() -> None:
    x = torch.tensor([[3.0, 4.0]])
    # mean(x^2) = 12.5 -> x / sqrt(12.5) * w
    w = torch.tensor([2.0, 0.5])
    out = rms_norm(x, w, 0.0)
    s = 1 / math.sqrt(12.5)
    assert torch.allclose(out, torch.tensor([[3 * s * 2.0, 4 * s * 0.5]]), rtol=1e-6)
    assert rms_norm(x.bfloat16(), None, 1e-6).dtype == torch.bfloat16


def test_rms_norm_tiny_eps_is_not_clamped() -> None:
    # V4.1 uses eps 1e-20: a tiny input must still be normalised to unit RMS (eps must not dominate)
    x = torch.full((1, 4), 1e-6)  # mean(x^2) = 1e-12
    assert torch.allclose(rms_norm(x, None, 1e-20), torch.ones(1, 4), rtol=1e-5)
    assert torch.allclose(rms_norm(x, None, 1e-6), torch.full((1, 4), 1e-6 / (1e-6 + 1e-12) ** 0.5), rtol=1e-5)


def test_yarn_range_real_config() -> None:
    # §2: theta 160000, L0 65536, beta 32/1, 64 rope dims -> low 15, high 25
    assert yarn_correction_range(64, 160000.0, 65536, 32.0, 1.0) == (15, 25)


def test_yarn_freqs_ramp() -> None:
    plain = rope_freqs(64, 160000.0)
    yarn = rope_freqs(64, 160000.0, yarn_factor=16.0, original_max_pos=65536, beta_fast=32.0, beta_slow=1.0)
    i = torch.arange(32, dtype=torch.float64)
    omega = 160000.0 ** (-2 * i / 64)
    assert torch.allclose(plain.double(), omega, rtol=1e-6)
    # pairs below low keep omega, above high are divided by the factor, in between linear blend
    assert torch.allclose(yarn[:16].double(), omega[:16], rtol=1e-6)
    assert torch.allclose(yarn[25:].double(), omega[25:] / 16, rtol=1e-6)
    ramp = (20 - 15) / (25 - 15)
    assert math.isclose(float(yarn[20]), float(omega[20] * (1 - ramp) + omega[20] / 16 * ramp), rel_tol=1e-6)


def test_apply_rope_interleaved_trailing_dims() -> None:
    # D = 6, rope on the last 4 dims (2 pairs); pair 0 at channels 2,3; pair 1 at 4,5
    x = torch.tensor([[10.0, 20.0, 1.0, 0.0, 0.0, 1.0]])
    cos = torch.tensor([[math.cos(math.pi / 2), math.cos(math.pi)]])
    sin = torch.tensor([[math.sin(math.pi / 2), math.sin(math.pi)]])
    out = apply_rope(x, cos, sin)
    # (a,b)->(a cos - b sin, a sin + b cos): (1,0) by 90deg -> (0,1); (0,1) by 180deg -> (0,-1)
    assert torch.allclose(out, torch.tensor([[10.0, 20.0, 0.0, 1.0, 0.0, -1.0]]), atol=1e-6)
    back = apply_rope(out, cos, sin, inverse=True)
    assert torch.allclose(back, x, atol=1e-6)


def test_rope_cos_sin_angles() -> None:
    freqs = torch.tensor([1.0, 0.5])
    cos, sin = rope_cos_sin(torch.tensor([0, 3]), freqs)
    assert torch.allclose(cos[1], torch.tensor([math.cos(3.0), math.cos(1.5)]))
    assert torch.allclose(sin[0], torch.zeros(2))


def _torch_pow_base(dim: int, theta: float) -> np.ndarray:
    """theta ** (i / dim) as torch computes it in fp32 (what the reference's own torch code gets on this machine)."""
    return (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)).numpy()


def _np_inv_freq(dim: int, theta: float, factor: float | None, l0: int) -> np.ndarray:
    """Independent fp32 (numpy) inverse frequencies, written from the reference's formula. The fp32 `pow` is a libm
    call whose last bit depends on the implementation (numpy's AVX-512 pow and torch's differ by 1 ulp on some
    CPUs), so its values come from torch, checked here against the correctly rounded pow within 1 ulp; every later
    step is an IEEE basic operation, exactly rounded everywhere, and must agree bit for bit."""
    f32 = np.float32
    exponent = np.arange(0, dim, 2, dtype=f32) / f32(dim)
    base = _torch_pow_base(dim, theta)
    exact = (np.float64(f32(theta)) ** exponent.astype(np.float64)).astype(f32)
    assert np.abs(base.view(np.int32) - exact.view(np.int32)).max() <= 1  # within 1 ulp of the exact pow
    extra = f32(1.0) / base
    if factor is None:
        return extra
    inter = f32(1.0) / (f32(factor) * base)

    def corr(rot: float) -> float:
        return dim * math.log(l0 / (rot * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(32.0)), 0), min(math.ceil(corr(1.0)), dim - 1)
    width = f32((high + 0.001 if low == high else high) - low)
    ramp = np.clip((np.arange(dim // 2, dtype=f32) - f32(low)) / width, f32(0), f32(1))
    mask = f32(1.0) - ramp
    return inter * (f32(1.0) - mask) + extra * mask


@pytest.mark.parametrize(
    ("theta", "factor", "l0"), [(10000.0, None, 0), (160000.0, 16.0, 65536), (160000.0, 16.0, 32), (1e4, 4.0, 2048)]
)
def test_rope_tables_equal_fp32_reference_bit_for_bit(theta: float, factor: float | None, l0: int) -> None:
    dim = 64
    kw = {} if factor is None else {"yarn_factor": factor, "original_max_pos": l0}
    freqs = rope_freqs(dim, theta, **kw)
    ref = _np_inv_freq(dim, theta, factor, l0)
    assert freqs.dtype == torch.float32
    assert np.array_equal(freqs.numpy().view(np.int32), ref.view(np.int32))
    # positions up to 1M (YaRN's 16 x 65536): the fp32 angle table is outer(positions_fp32, inv_freq_fp32)
    pos = torch.cat([torch.arange(0, 4096), torch.arange(4096, 1 << 20, 7919), torch.tensor([(1 << 20) - 1])])
    cos, sin = rope_cos_sin(pos, freqs)
    ang = np.outer(pos.numpy().astype(np.float32), ref)
    z = torch.polar(torch.ones(ang.shape), torch.from_numpy(ang))  # the reference's cos/sin of that table
    assert torch.equal(cos.view(torch.int32), z.real.contiguous().view(torch.int32))
    assert torch.equal(sin.view(torch.int32), z.imag.contiguous().view(torch.int32))
    # and cos/sin are those of the fp32 angle (within 1 ulp of the correctly rounded value), not of a wider one
    exact_c = torch.from_numpy(np.cos(ang.astype(np.float64)).astype(np.float32))
    assert ((cos.view(torch.int32) - exact_c.view(torch.int32)).abs() <= 1).all()


def test_rope_angles_are_fp32_not_float64() -> None:
    # at position 1M the fp32 angle differs from the float64 product: the table must follow the fp32 one
    freqs = rope_freqs(64, 160000.0, yarn_factor=16.0, original_max_pos=65536)
    pos = torch.tensor([1_000_003])
    cos, _ = rope_cos_sin(pos, freqs)
    wide = torch.cos(pos.double()[:, None] * freqs.double()[None, :]).float()
    assert (cos - wide).abs().max().item() > 1e-3


def test_apply_rope_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="rope dims exceed"):
        apply_rope(torch.zeros(1, 2), torch.zeros(1, 2), torch.zeros(1, 2))
