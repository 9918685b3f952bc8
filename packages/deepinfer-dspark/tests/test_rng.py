"""Counter-based uniforms: pure function of (seed, position, draw), uniform, independent across keys."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_dspark import (
    DSparkInputError,
    counter_uniforms,
    verify_counter_uniforms,
    verify_counter_uniforms_host,
)
from deepinfer_dspark.rng import DRAW_ACCEPT, DRAW_DRAFT, DRAW_FINAL

CHI2_CRIT_1E3_DF63 = 103.442  # chi-square, 63 degrees of freedom, significance 1e-3 (standard table)


def test_pure_function_of_the_key():
    seeds = torch.tensor([0, -5, 2**40 + 3, 7], dtype=torch.int64)
    pos = torch.tensor([[0, 1], [5, 6], [1 << 33, 2], [9, 9]], dtype=torch.int64)
    u = counter_uniforms(seeds, pos, DRAW_DRAFT)
    assert u.dtype == torch.float32 and u.shape == (4, 2)
    assert bool(((u >= 0) & (u < 1)).all())
    assert torch.equal(u, counter_uniforms(seeds, pos, DRAW_DRAFT))
    # any subset / order of requests gives the same values (batch independence)
    assert torch.equal(counter_uniforms(seeds[[3, 0]], pos[[3, 0]], DRAW_DRAFT), u[[3, 0]])
    assert torch.equal(counter_uniforms(seeds, pos[:, 0], DRAW_DRAFT), u[:, 0])
    # equal positions of one seed -> equal values; another draw -> another value
    assert u[3, 0] == u[3, 1]
    assert not torch.equal(u, counter_uniforms(seeds, pos, DRAW_ACCEPT))


def test_uniform_and_uncorrelated():
    n = 64 * 2000
    seeds = torch.arange(n, dtype=torch.int64) // 16
    pos = torch.arange(n, dtype=torch.int64) % 16
    u = counter_uniforms(seeds, pos, DRAW_ACCEPT)
    counts = torch.bincount((u * 64).long(), minlength=64).double()
    chi2 = float(((counts - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < CHI2_CRIT_1E3_DF63, chi2
    v = counter_uniforms(seeds, pos, DRAW_FINAL)
    w = counter_uniforms(seeds, pos + 1, DRAW_ACCEPT)
    for other in (v, w):
        r = torch.corrcoef(torch.stack([u, other]).double())[0, 1]
        assert abs(float(r)) < 4 / n**0.5  # 4 standard errors of a zero correlation
    assert abs(float(u.mean()) - 0.5) < 4 * (1 / 12 / n) ** 0.5


def test_verify_uniform_layout():
    seeds, p = torch.tensor([3, 4]), torch.tensor([10, 20])
    u = verify_counter_uniforms(seeds, p, 3)
    assert u.shape == (2, 4)
    assert torch.equal(u[:, :3], counter_uniforms(seeds, torch.stack([p + 1, p + 2, p + 3], 1), DRAW_ACCEPT))
    assert torch.equal(u[:, 3], counter_uniforms(seeds, p, DRAW_FINAL))
    # one pass over both namespaces == one call per namespace, for negative / wide seeds and positions >= 2^32
    seeds, p = torch.tensor([-5, 2**40 + 3, 0]), torch.tensor([1 << 33, 0, (1 << 32) - 2])
    u = verify_counter_uniforms(seeds, p, 2)
    assert torch.equal(u[:, :2], counter_uniforms(seeds, torch.stack([p + 1, p + 2], 1), DRAW_ACCEPT))
    assert torch.equal(u[:, 2], counter_uniforms(seeds, p, DRAW_FINAL))


def test_host_verify_uniforms_equal_the_device_ones_bit_for_bit():
    """The engine computes a round's verification uniforms on the host; they must be the device function's values
    exactly (a different value could flip an acceptance), over the whole key space: negative and 63-bit seeds (the
    lanes wrap alike), positions past 2^32."""
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(-(2**62), 2**62, (60,), generator=g), torch.tensor([2**63 - 1, -(2**63), 0, -1])])
    p = torch.cat([torch.randint(0, 2**40, (60,), generator=g), torch.tensor([0, 1 << 32, (1 << 32) - 1, 7])])
    for width in (0, 1, 5):
        host = verify_counter_uniforms_host(seeds.numpy(), p.numpy(), width)
        assert host.dtype == np.float32 and host.shape == (64, width + 1)
        assert torch.equal(torch.from_numpy(host), verify_counter_uniforms(seeds, p, width))
    with pytest.raises(DSparkInputError, match="seeds"):
        verify_counter_uniforms_host(seeds.numpy(), p.numpy()[:3], 2)


def test_errors():
    with pytest.raises(DSparkInputError, match="seeds"):
        counter_uniforms(torch.tensor([1.0]), torch.tensor([1]), 0)
    with pytest.raises(DSparkInputError, match="positions"):
        counter_uniforms(torch.tensor([1]), torch.tensor([1, 2]), 0)
    with pytest.raises(DSparkInputError, match="draw"):
        counter_uniforms(torch.tensor([1]), torch.tensor([1]), -1)
