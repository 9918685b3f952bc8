"""bf16 mode on CPU: `load_model(dir, dtype=torch.bfloat16)` of the tiny V4.1 / V4 checkpoints runs, keeps fp32 where
the spec says (mHC, sinks, gate bias, compressor ape / state, confidence head; fp32 logits) and stays close to the
fp32 model. Same criteria as the CUDA bf16 test (test_model_cuda.py), per position e = ||Δ||₂ / ||ref||₂:
median(e) <= 5e-2, e <= 5e-2 on >= 60% of the positions, top-1 agreement >= 70% (bf16 flips a few discrete
choices, indexer top-k / experts, so there is no max bound)."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.loader import load_model
from engine_testing import make_tiny_checkpoint
from equality import run_chunked, run_full

BF16_MEDIAN, BF16_ROW_TOL, BF16_ROW_FRAC, BF16_TOP1 = 5e-2, 5e-2, 0.6, 0.7


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


@pytest.fixture(scope="module", params=["v41", "v4"])
def pair(request, tmp_path_factory):
    d = make_tiny_checkpoint(tmp_path_factory.mktemp(f"bf16_{request.param}") / "ckpt", arch=request.param, seed=0)
    return load_model(d, dtype=torch.float32), load_model(d, dtype=torch.bfloat16)


def test_bf16_parameters_and_cache_dtypes(pair) -> None:
    _, m16 = pair
    params = dict(m16.named_parameters())
    for name, p in params.items():
        fp32 = name.endswith(("_fn", "_base", "_scale", "attn_sink", "gate.bias", "gate.bias_vl", ".ape")) or (
            "confidence_head" in name
        )
        if fp32:
            assert p.dtype == torch.float32, name
    for name in ("embed.weight", "head.weight", "layers.0.attn.q_norm.weight"):
        assert params[name].dtype == torch.bfloat16, name
    # quantized tensors stay in their checkpoint formats whatever the model dtype
    assert params["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert params["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert params["layers.0.ffn.experts.w1.weight"].dtype == torch.int8
    assert m16.layers[0].attn.wq_a.dtype == torch.bfloat16  # compute dtype
    cache = ModelCache.allocate(m16.args, num_slots=1, num_pages=2, page_size=16, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in cache.swa.values())
    assert all(t.dtype == torch.float32 for t in cache.comp_state.values())


def test_bf16_logits_close_to_fp32(pair) -> None:
    m32, m16 = pair
    ids = torch.randint(3, 128000, (32,), generator=torch.Generator().manual_seed(0))
    ref = run_full(m32, ids)
    for got in (run_full(m16, ids), run_chunked(m16, ids, [7, 1, 1, 12, 11])):
        assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
        e = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
        med, frac = float(e.median()), float((e <= BF16_ROW_TOL).float().mean())
        top1 = float((got.argmax(-1) == ref.argmax(-1)).float().mean())
        assert med <= BF16_MEDIAN and frac >= BF16_ROW_FRAC and top1 >= BF16_TOP1, (med, frac, top1)
        assert med > 0  # really computed in bf16 (an fp32 run would be bit-equal here)
