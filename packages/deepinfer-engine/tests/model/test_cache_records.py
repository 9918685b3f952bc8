"""kv_cache_dtype="auto": the cache stores deployed V4.1 records (MXFP8 window, NVFP4 entries, MXFP4 index keys).

Exact equalities: the values a layer sees are decoded records in every mode of feeding (the step that writes a
row also gets it back decoded), so full == chunked == token-by-token holds to the same fp32 tolerance as the
plain cache. Sizes: the allocation equals `cache_families(..., kv_cache_dtype="auto")` byte for byte.
"""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.errors import ConfigError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.cache_layout import cache_families
from deepinfer_engine.model.engram_hash import synthetic_token_map
from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_config, tiny_v41_config, v41_flash_config
from deepinfer_kernels.quant.kv_formats import MXFP8_E4M3, decode_records, fake_quant
from equality import init_random_, max_rel_err


def _args() -> ModelArgs:
    cfg = tiny_v41_config()
    cfg["text_config"]["index_head_dim"] = 32  # MXFP4 keys need a multiple of its 32-channel block (tiny has 16)
    return ModelArgs.from_config_dict(cfg)


def test_auto_allocates_records_and_sizes_match_the_families():
    a = _args()
    c = ModelCache.allocate(a, num_slots=1, num_pages=1, page_size=16, dtype=torch.float32, device="meta",
                            kv_cache_dtype="auto")
    D, Di = a.head_dim, a.index_head_dim
    assert all(t.dtype == torch.uint8 and t.shape[-1] == D + D // 32 for t in c.swa.values())
    assert all(t.dtype == torch.uint8 and t.shape[-1] == D // 2 + D // 16 for t in c.compressed_kv.values())
    assert all(t.dtype == torch.uint8 and t.shape[-1] == Di // 2 + Di // 32 for t in c.index_keys.values())
    fams = {f.name: f for f in cache_families(a, 16, torch.float32, kv_cache_dtype="auto")}
    # the storage holds 2 slots / pages: the requested one + the scratch one of fixed-shape (CUDA-graph) steps
    nb = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 2  # noqa: E731
    assert fams["swa_ring"].bytes_per_slot == nb(c.swa.values())
    assert fams["compressor_state"].bytes_per_slot == nb(c.comp_state.values())
    assert fams["compressed_kv"].bytes_per_token == nb(c.compressed_kv.values()) / 16
    assert fams["indexer_keys"].bytes_per_token == nb(c.index_keys.values()) / 16


def test_real_v41_global_kv_is_890_bytes_per_token():
    a = ModelArgs.from_config_dict(v41_flash_config())
    fams = {f.name: f for f in cache_families(a, 128, torch.bfloat16, kv_cache_dtype="auto")}
    assert fams["compressed_kv"].bytes_per_token + fams["indexer_keys"].bytes_per_token == pytest.approx(890)


def test_auto_rejects_what_it_cannot_store():
    with pytest.raises(ConfigError, match="arch"):
        ModelCache.allocate(ModelArgs.from_config_dict(tiny_v4_config()), num_slots=1, num_pages=1, page_size=16,
                            dtype=torch.float32, kv_cache_dtype="auto")
    with pytest.raises(ConfigError, match="index_head_dim = 16"):
        ModelCache.allocate(ModelArgs.from_config_dict(tiny_v41_config()), num_slots=1, num_pages=1, page_size=16,
                            dtype=torch.float32, kv_cache_dtype="auto")
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        ModelCache.allocate(_args(), num_slots=1, num_pages=1, page_size=16, dtype=torch.float32,
                            kv_cache_dtype="fp8")


def test_window_rows_are_stored_as_fp8_records_and_read_back_decoded():
    a = _args()
    cache, bt = ModelCache.allocate_dense(a, [12], dtype=torch.float32, kv_cache_dtype="auto")
    kv = torch.randn(12, a.head_dim, generator=torch.Generator().manual_seed(0)) * 3
    W = a.sliding_window
    ctx = ForwardContext.build(ForwardBatch.single(torch.zeros(8, dtype=torch.int64), block_table=bt[0]), cache)
    pool = cache.window_pool(0, ctx.ring_plan(cache.window_rows(0), (W - 1,), write=True), kv[:8])
    want = fake_quant(kv, MXFP8_E4M3)
    # the pool holds the records themselves (the attention decodes them in its gather), this step's rows too
    assert pool.dtype == torch.uint8 and cache.window_format() is MXFP8_E4M3
    assert torch.equal(decode_records(pool, MXFP8_E4M3), want[:8])
    ctx = ForwardContext.build(
        ForwardBatch.single(torch.zeros(4, dtype=torch.int64), start_pos=8, block_table=bt[0]), cache
    )
    pool = cache.window_pool(0, ctx.ring_plan(cache.window_rows(0), (W - 1,), write=True), kv[8:])
    # history from the stored records, then this step
    assert torch.equal(decode_records(pool, MXFP8_E4M3), want[max(0, 8 - (W - 1)) :])


@torch.no_grad()
def test_records_read_in_place_equal_the_deployed_numerics_over_a_plain_cache():
    """The attention reads the MXFP8 window and NVFP4 entry records in place (decoded in its gather), the indexer
    decodes its MXFP4 keys: the logits equal the same deployed numerics applied as rounding into a plain fp32
    cache, in full, chunked and batched feeding."""
    a = _args()
    model = init_random_(Transformer(a, torch.float32, with_draft=False), seed=5)
    model.set_engram_token_map(synthetic_token_map(a.vocab_size, a.engram_compressed_vocab_size))
    ids = torch.randint(3, a.vocab_size, (29,), generator=torch.Generator().manual_seed(2))

    def run(records, chunks):
        model.set_deployed_numerics(True, cache_records=records)
        cache, bt = ModelCache.allocate_dense(a, [ids.numel()], dtype=torch.float32,
                                              kv_cache_dtype="auto" if records else "bfloat16")  # fmt: skip
        assert (cache.entry_format() is not None) == records
        out, s = [], 0
        for c in chunks:
            out.append(model(ForwardBatch.single(ids[s : s + c], start_pos=s, block_table=bt[0]), cache))
            s += c
        return torch.cat(out)

    try:
        for chunks in ([29], [6, 1, 9, 13], [1] * 29):
            assert max_rel_err(run(True, chunks), run(False, chunks)) < 1e-5, chunks
    finally:
        model.set_deployed_numerics(False)


@torch.no_grad()
def test_full_equals_chunked_and_decode_with_records():
    a = _args()
    model = init_random_(Transformer(a, torch.float32, with_draft=False), seed=3)
    model.set_engram_token_map(
        synthetic_token_map(a.vocab_size, a.engram_compressed_vocab_size)
    )
    ids = torch.randint(3, a.vocab_size, (23,), generator=torch.Generator().manual_seed(1))

    def run(chunks):
        cache, bt = ModelCache.allocate_dense(a, [ids.numel()], dtype=torch.float32, kv_cache_dtype="auto")
        out, s = [], 0
        for c in chunks:
            out.append(model(ForwardBatch.single(ids[s : s + c], start_pos=s, block_table=bt[0]), cache))
            s += c
        return torch.cat(out)

    full = run([23])
    assert max_rel_err(run([5, 1, 7, 3, 7]), full) < 1e-5
    assert max_rel_err(run([1] * 23), full) < 1e-5
    plain_cache, bt = ModelCache.allocate_dense(a, [ids.numel()], dtype=torch.float32)
    plain = model(ForwardBatch.single(ids, block_table=bt[0]), plain_cache)
    # the records really change the numbers (the size of the change is measured in docs/kv_cache.md, not bounded
    # here: on random tiny weights FP4 keys flip indexer selections)
    assert max_rel_err(full, plain) > 0


def test_record_format_takes_the_kernel_backend():
    """RecordFormat.encode / decode go through deepinfer_kernels.kv_records: with backend="triton" (the interpreter
    here, one launch each on the GPU) the records and the decoded values are the torch reference's, byte for byte."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed")
    from deepinfer_engine.model.cache import _record_formats
    from kernels_testing import triton_interpreter

    a = _args()
    g = torch.Generator().manual_seed(0)
    with triton_interpreter("deepinfer_kernels.kv_records.triton"):
        for family, f in _record_formats(a, "auto").items():
            x = torch.randn(9, f.dim, generator=g) * 3
            rec = f.encode(x, "triton")
            assert torch.equal(rec, f.encode(x, "torch")), family
            assert torch.equal(f.decode(rec, torch.float32, "triton"), f.decode(rec, torch.float32, "torch")), family
