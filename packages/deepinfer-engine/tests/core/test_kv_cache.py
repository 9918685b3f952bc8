"""Slot/page pool: capacity from a byte budget, all-or-nothing allocation, freeing."""

from __future__ import annotations

import pytest
from deepinfer_engine.core.kv_cache import KVCacheManager, plan_cache
from deepinfer_engine.core.kv_cache_spec import CacheFamily
from deepinfer_engine.core.request import Request
from deepinfer_engine.errors import CapacityError

FAMS = [
    CacheFamily(name="compressed_kv", kind="paged", num_layers=2, bytes_per_token=10.0),
    CacheFamily(name="index_keys", kind="paged", num_layers=2, bytes_per_token=2.5),
    CacheFamily(name="swa_ring", kind="slot", num_layers=4, bytes_per_slot=1000),
]


def test_plan_from_budget() -> None:
    # page = 16 tokens x 12.5 B = 200 B; slot = 1000 B; 10_000 B -> min(4, 10000 // 1200 = 8) = 4 slots,
    # (10000 - 4000) // 200 = 30 pages
    plan = plan_cache(FAMS, page_size=16, memory_bytes=10_000, max_num_seqs=4, max_model_len=1024)
    assert (plan.bytes_per_page, plan.bytes_per_slot, plan.num_slots, plan.num_pages) == (200, 1000, 4, 30)
    # never more pages than all slots filled to max_model_len: 4 slots x ceil(40 / 16) = 12
    capped = plan_cache(FAMS, page_size=16, memory_bytes=10_000, max_num_seqs=4, max_model_len=40)
    assert capped.num_pages == 12
    assert plan.total_bytes <= 10_000
    text = "\n".join(plan.describe())
    assert "compressed_kv: paged, 2 layer(s), 10 B/token" in text and "12.5 B/token" in text
    # budget smaller than max_num_seqs slots: slots shrink so each keeps at least one page
    small = plan_cache(FAMS, page_size=16, memory_bytes=3000, max_num_seqs=8, max_model_len=1024)
    assert small.num_slots == 2 and small.num_pages == 5


def test_plan_too_small_names_option_and_numbers() -> None:
    with pytest.raises(CapacityError, match=r"kv_cache_memory_bytes: 500 B .* 1200 B"):
        plan_cache(FAMS, page_size=16, memory_bytes=500, max_num_seqs=4, max_model_len=64)


def test_overrides_and_no_paged_families() -> None:
    plan = plan_cache(FAMS, page_size=8, memory_bytes=None, max_num_seqs=3, max_model_len=40, num_pages=7)
    assert plan.num_pages == 7 and plan.num_slots == 3
    swa_only = plan_cache(FAMS[2:], page_size=8, memory_bytes=10_000, max_num_seqs=3, max_model_len=40)
    assert swa_only.bytes_per_page == 0 and swa_only.num_pages == 3 * 5


def _req(rid: str, n: int) -> Request:
    return Request(rid, list(range(n)), max_tokens=4)


def test_allocate_is_all_or_nothing_and_free_returns_everything() -> None:
    kv = KVCacheManager(page_size=4, num_pages=5, num_slots=2)
    a, b, c = _req("a", 9), _req("b", 3), _req("c", 1)
    assert kv.allocate(a, 9) and kv.page_ids("a") == [0, 1, 2] and kv.slot("a") == 0
    assert not kv.allocate(b, 9)  # needs 3 pages, 2 free
    assert kv.num_free_pages == 2 and kv.num_free_slots == 1 and kv.page_ids("b") == []
    assert kv.allocate(b, 3) and kv.slot("b") == 1
    assert not kv.allocate(c, 1)  # no slot left
    a.num_computed_tokens = 9
    assert kv.allocate(a, 3)  # 12 tokens still fit 3 pages
    assert kv.page_ids("a") == [0, 1, 2]
    assert kv.allocate(a, 4) and kv.page_ids("a") == [0, 1, 2, 4]
    kv.free(a)
    kv.free(b)
    assert kv.num_free_pages == 5 and kv.num_free_slots == 2
    assert kv.can_ever_fit(20) and not kv.can_ever_fit(21)
