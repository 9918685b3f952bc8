"""Deployed KV numerics (kv_cache_dtype "auto", docs/fidelity.md §5): the rounded values are the stored records,
and full == token-by-token decode == chunked prefill == batched still hold (fp32 CPU, tiny V4.1 and V4).

The equalities are greedy: the argmax token of every position is identical in every mode. The logits themselves
agree to 1e-5 except where a rounding flips: full and chunked fp32 differ by ulps (other matmul shapes, other
reduction orders), and a value within an ulp of a rounding boundary of a 3-bit (FP8) or 1-bit (FP4) mantissa
rounds one step apart. Observed on 8 seeds: <= 3.4e-3 max relative logit difference, greedy always equal; the
bound asserted is 1e-2. The printed "deployed vs off" numbers are the logit error the record formats cause.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.engram_hash import synthetic_token_map
from deepinfer_engine.model.kv_numerics import V4_FP8_NOPE, KVNumerics, kv_numerics
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_config, tiny_v41_config
from deepinfer_kernels.quant.kv_formats import MXFP4_E2M1, MXFP8_E4M3, NVFP4_E2M1, fake_quant
from equality import init_random_, max_rel_err, run_batched, run_chunked, run_full

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py

FLIP_TOL = 1e-2  # max |Δ| / max |ref| of the logits when a rounding flips (see above)


def _same_greedy(got: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = max_rel_err(got, ref)
    print(f"{what}: max rel err {err:.3g}")
    assert torch.equal(got.argmax(-1), ref.argmax(-1)), what
    assert err <= FLIP_TOL, what


def _model(arch: str, seed: int, deployed: bool) -> Transformer:
    args = ModelArgs.from_config_dict(tiny_v41_config() if arch == "v41" else tiny_v4_config())
    m = Transformer(args, torch.float32, deployed_numerics=deployed)
    init_random_(m, seed=seed)
    if args.engram_layer_ids:
        m.set_engram_token_map(synthetic_token_map(args.vocab_size, args.engram_compressed_vocab_size))
    return m.eval()


@pytest.fixture(scope="module", params=["v41", "v4"])
def model(request) -> Transformer:
    return _model(request.param, seed=13, deployed=True)


def _ids(model: Transformer, n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed))


def test_formats_per_arch() -> None:
    v41 = kv_numerics(ModelArgs.from_config_dict(tiny_v41_config()), True)
    assert (v41.window, v41.compressed, v41.index, v41.bf16_index_scores) == (
        MXFP8_E4M3, NVFP4_E2M1, MXFP4_E2M1, True
    )  # fmt: skip
    v4 = kv_numerics(ModelArgs.from_config_dict(tiny_v4_config()), True)
    assert (v4.window, v4.compressed, v4.index, v4.rope_dims) == (V4_FP8_NOPE, V4_FP8_NOPE, None, 8)
    assert not kv_numerics(ModelArgs.from_config_dict(tiny_v41_config()), False).enabled


def test_window_kv_is_the_record_round_trip() -> None:
    x = torch.randn(5, 512) * 3
    assert torch.equal(KVNumerics(window=MXFP8_E4M3).window_kv(x), fake_quant(x, MXFP8_E4M3))
    # V4: non-RoPE dims rounded per 64, the 64 RoPE dims untouched
    v4 = KVNumerics(window=V4_FP8_NOPE, rope_dims=64).window_kv(x)
    assert torch.equal(v4[:, 448:], x[:, 448:]) and torch.equal(v4[:, :448], fake_quant(x[:, :448], V4_FP8_NOPE))
    # a row shorter than a block (tiny models) is one partial block: same as zero padding
    short = torch.randn(3, 16)
    got = KVNumerics(index=MXFP4_E2M1).index_operand(short)
    assert torch.equal(got, fake_quant(torch.cat([short, torch.zeros(3, 16)], 1), MXFP4_E2M1)[:, :16])


def test_stored_records_are_on_their_grids() -> None:
    m = _model("v41", seed=2, deployed=True)
    from deepinfer_engine.model.cache import ModelCache
    from deepinfer_engine.model.forward_batch import ForwardBatch

    ids = _ids(m, 12, 1)
    cache, bt = ModelCache.allocate_dense(m.args, [12], dtype=torch.float32)
    with torch.no_grad():
        m(ForwardBatch.single(ids, block_table=bt[0]), cache)
    for lid, store in cache.compressed_kv.items():
        if store is None:
            continue
        rows = store.reshape(-1, store.shape[-1])
        rows = rows[rows.abs().sum(-1) > 0]
        assert rows.shape[0] > 0 and torch.equal(fake_quant(rows, NVFP4_E2M1), rows), lid
        keys = cache.index_keys[lid].reshape(-1, cache.index_keys[lid].shape[-1])
        keys = keys[keys.abs().sum(-1) > 0]
        pad = torch.zeros(keys.shape[0], (-keys.shape[1]) % 32)
        assert torch.equal(fake_quant(torch.cat([keys, pad], 1), MXFP4_E2M1)[:, : keys.shape[1]], keys), lid
    for lid, ring in cache.swa.items():
        rows = ring.reshape(-1, ring.shape[-1])
        rows = rows[rows.abs().sum(-1) > 0]
        assert torch.equal(fake_quant(rows, MXFP8_E4M3), rows), lid


def test_decode_and_chunks_equal_full(model: Transformer) -> None:
    ids = _ids(model, 33, 7)
    full = run_full(model, ids)
    for chunks in ([1] * 33, [3, 1, 4, 1, 5, 9, 10], [2, 13, 18]):
        _same_greedy(run_chunked(model, ids, chunks), full, f"{model.args.arch} deployed chunks {chunks[:4]}...")


def test_batched_equals_full(model: Transformer) -> None:
    seqs = [_ids(model, n, 20 + n) for n in (21, 9, 14)]
    fulls = [run_full(model, s) for s in seqs]
    for i, (o, f) in enumerate(zip(run_batched(model, seqs, seed=3, max_chunk=6), fulls)):
        _same_greedy(o, f, f"{model.args.arch} deployed batched seq {i}")


def test_deployed_mode_is_live_and_its_error_is_measured(model: Transformer) -> None:
    ids = _ids(model, 40, 9)
    dep = run_full(model, ids)
    model.set_deployed_numerics(False)
    try:
        off = run_full(model, ids)
    finally:
        model.set_deployed_numerics(True)
    err = max_rel_err(dep, off)
    agree = float((dep.argmax(-1) == off.argmax(-1)).float().mean())
    print(f"{model.args.arch} tiny: deployed vs off max rel logit err {err:.3g}, greedy agreement {agree:.2f}")
    assert err > 1e-4  # the rounding reaches the logits
