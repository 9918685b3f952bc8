"""ModelCache families and addressing (docs/caches.md §7, contracts §3): rings by position, paged entries."""

from __future__ import annotations

import pytest
import torch
from deepinfer_engine.errors import CapacityError, ConfigError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import DEFAULT_SLACK, ModelCache, paged_read, paged_write, ring_history
from deepinfer_engine.model.presets import tiny_v4_config, tiny_v41_config


def test_families_v4():
    a = ModelArgs.from_config_dict(tiny_v4_config())
    c = ModelCache.allocate(a, num_slots=3, num_pages=5, page_size=16, dtype=torch.float32)
    assert set(c.swa) == set(range(7))  # 6 layers + MTP, each its own ring
    assert c.swa[0].shape == (3 + 1, a.sliding_window + DEFAULT_SLACK, a.head_dim)
    # CSA (layer 1): main overlap state 2*ratio rows of [A | Z] at 2*head_dim, indexer state, keys; HCA: main only
    assert c.comp_state[(1, "main")].shape == (3 + 1, 8 + DEFAULT_SLACK, 2, 2 * a.head_dim)
    assert c.comp_state[(1, "indexer")].shape == (3 + 1, 8 + DEFAULT_SLACK, 2, 2 * a.index_head_dim)
    assert c.comp_state[(2, "main")].shape == (3 + 1, 8 + DEFAULT_SLACK, 2, a.head_dim)
    assert (2, "indexer") not in c.comp_state
    # storage: + the scratch slot / page of fixed-shape (CUDA-graph) steps
    assert c.compressed_kv[1].shape == (5 + 1, 16 // 4, a.head_dim) and c.compressed_kv[2].shape == (5 + 1, 2, a.head_dim)
    assert set(c.index_keys) == {1, 3, 5}
    assert c.token_ring is None


def test_families_v41():
    a = ModelArgs.from_config_dict(tiny_v41_config())
    c = ModelCache.allocate(a, num_slots=2, num_pages=4, page_size=8, dtype=torch.float32)
    assert set(c.compressed_kv) == {2, 4, 5}  # kv sources only
    assert c.compressed_kv[5].shape == (4 + 1, 8, a.head_dim)  # ratio 1 (+ the scratch page)
    assert set(c.index_keys) == {2, 4, 5}
    assert set(k for k, _ in c.comp_state) == {2, 4}  # ratio-2 sources keep (A, Z) rows; ratio 1 needs none
    # device token ring (+ the scratch slot), -1 = never written
    assert c.token_ring.shape == (2 + 1, a.engram_max_ngram_size + DEFAULT_SLACK)
    assert c.token_ring.dtype == torch.int64 and bool((c.token_ring == -1).all())


def test_page_size_must_be_multiple_of_ratios():
    a = ModelArgs.from_config_dict(tiny_v4_config())
    with pytest.raises(ConfigError, match="page_size"):
        ModelCache.allocate(a, num_slots=1, num_pages=1, page_size=12, dtype=torch.float32)


def test_ring_history_reads_before_writing_long_chunks():
    ring = torch.zeros(2, 4, 1)
    # positions 0..5 in slot 1: the ring keeps the last 4 (rows = position mod 4)
    out = ring_history(ring, 1, 0, torch.arange(6.0)[:, None], back=3)
    assert out[:, 0].tolist() == [0, 1, 2, 3, 4, 5]
    assert ring[1, :, 0].tolist() == [4, 5, 2, 3]
    # next chunk of 5 (longer than the ring) at position 6: history 3..5 comes from the ring, read before the write
    out = ring_history(ring, 1, 6, torch.arange(6.0, 11.0)[:, None], back=3)
    assert out[:, 0].tolist() == [3, 4, 5, 6, 7, 8, 9, 10]
    assert ring[1, :, 0].tolist() == [8, 9, 10, 7]
    assert ring[0].abs().sum() == 0  # other slot untouched
    with pytest.raises(CapacityError):
        ring_history(ring, 0, 10, torch.zeros(1, 1), back=5)


def test_paged_addressing_formula():
    # entry w of ratio r -> page block_table[w*r // page_size], row (w*r % page_size) // r
    store = torch.zeros(6, 4, 1)  # page_size 8, ratio 2 -> 4 rows per page
    bt = torch.tensor([5, 2, -1], dtype=torch.int32)
    w = torch.arange(8)
    paged_write(store, bt, 2, 8, w, (w.float() + 1)[:, None])
    assert store[5, :, 0].tolist() == [1, 2, 3, 4] and store[2, :, 0].tolist() == [5, 6, 7, 8]
    assert paged_read(store, bt, 2, 8, 6)[:, 0].tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(CapacityError, match="no page"):
        paged_write(store, bt, 2, 8, torch.tensor([8]), torch.ones(1, 1))


@pytest.mark.parametrize("cfg", [tiny_v4_config, tiny_v41_config])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_families_match_allocation(cfg, dtype):
    from deepinfer_engine.model.cache_layout import cache_families

    a = ModelArgs.from_config_dict(cfg())
    page = 16
    fams = {f.name: f for f in cache_families(a, page, dtype)}
    c = ModelCache.allocate(a, num_slots=1, num_pages=1, page_size=page, dtype=dtype, device="meta")
    # the storage holds 2 slots / pages: the requested one + the scratch one of fixed-shape steps
    nb = lambda ts: sum(t.numel() * t.element_size() for t in ts) / 2  # noqa: E731
    assert fams["swa_ring"].bytes_per_slot == nb(c.swa.values())
    assert fams["compressor_state"].bytes_per_slot == nb(c.comp_state.values())
    assert fams["compressed_kv"].bytes_per_token == nb(c.compressed_kv.values()) / page
    assert fams["indexer_keys"].bytes_per_token == nb(c.index_keys.values()) / page
    assert "engram_history" not in fams  # the Engram token ring lives on the host (row ids are hashed there)


@pytest.mark.parametrize("cfg", ["tiny_v4_config", "tiny_v41_config", "v4_flash_config", "v41_flash_config"])
def test_layer_specs_are_the_one_owner_rule(cfg):
    """The bare-config owner list (core.compressed_owners, used without a model) equals the one derived from the
    layer plans (core.layer_cache_spec), which the allocation and the byte accounting use."""
    from deepinfer_engine.core.kv_cache_spec import compressed_owners, layer_cache_specs, owners_from_specs
    from deepinfer_engine.model import presets

    a = ModelArgs.from_config_dict(getattr(presets, cfg)())
    bare = compressed_owners(a.compress_ratios, a.num_hidden_layers, getattr(a, "kv_source_layer_ids", None) or None)
    assert owners_from_specs(layer_cache_specs(a)) == bare
