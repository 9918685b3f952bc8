"""Prefix cache bookkeeping (pure Python): hash chain, refcounts, LRU eviction that never touches held pages,
host tier ops, exact-replay state blocks, the cache manager's hits and ops, and the scheduler sharing a page that
another request computes in the same step."""

from __future__ import annotations

import pytest
from deepinfer_engine.core.kv_cache import KVCacheManager, PrefixCaching, plan_cache
from deepinfer_engine.core.kv_cache_spec import CacheFamily
from deepinfer_engine.core.prefix_cache import PagePool, StatePool, block_hash, block_hashes
from deepinfer_engine.core.request import Request
from deepinfer_engine.core.sched_output import ModelRunnerOutput
from deepinfer_engine.core.scheduler import Scheduler


def test_hash_chain_depends_on_every_earlier_token_and_extra() -> None:
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2  # the partial tail page has no hash
    assert a == block_hashes(list(range(10)), 4)
    assert a[1] == block_hash(a[0], [4, 5, 6, 7])
    b = block_hashes([99, 1, 2, 3, 4, 5, 6, 7], 4)
    assert b[0] != a[0] and b[1] != a[1]  # same tokens of page 1, different parent
    assert block_hash(None, [1, 2]) != block_hash(None, [1, 2], b"image:7")
    assert block_hash(None, [1, 2]) != block_hash(None, [2, 1])
    assert block_hash(None, [2**40]) != block_hash(None, [0])  # int64 ids, no truncation


def test_refcounts_lru_and_held_pages_are_never_evicted() -> None:
    pool = PagePool(4)
    a = pool.take(2)
    b = pool.take(2)
    assert a == [0, 1] and b == [2, 3] and pool.take(1) is None and pool.num_free == 0
    for p, h in zip(a, (b"a0", b"a1")):
        assert pool.register(p, h)
    assert not pool.register(b[0], b"a0")  # content already cached in page 0: page 2 stays unshared
    pool.acquire([0])  # a second request hits page 0
    pool.release(a)  # the first request finishes: page 1 evictable, page 0 still held
    assert pool.refcount(0) == 1 and pool.is_evictable(1) and not pool.is_evictable(0)
    assert pool.num_free == 1
    assert pool.take(2) is None  # page 0 is held: never evicted
    assert pool.take(1) == [1] and pool.num_evicted == 1 and pool.match([b"a0", b"a1"]).device == (0,)
    pool.release([0])
    assert pool.match([b"a0"]).device == (0,) and pool.is_evictable(0)


def test_lru_evicts_least_recent_chain_tail_first() -> None:
    pool = PagePool(6)
    x = pool.take(3)
    for k, p in enumerate(x):
        pool.register(p, b"x%d" % k)
    y = pool.take(2)
    for k, p in enumerate(y):
        pool.register(p, b"y%d" % k)
    pool.release(x)
    pool.release(y)  # y released later: more recent
    assert pool.take(1) == [5]  # the free page first
    assert pool.take(1) == [x[2]]  # then the tail of the least recently released chain
    assert pool.match([b"x0", b"x1", b"x2"]).device == (x[0], x[1])
    pool.acquire([x[0]])  # a hit refreshes: x0 held, x1 next to go, then y's tail
    pool.release([x[0]])
    assert pool.take(2) == [x[1], y[1]]


def test_host_tier_offload_load_and_deferred_reuse() -> None:
    pool = PagePool(2, num_host_pages=1)
    p = pool.take(2)
    pool.register(p[0], b"h0")
    pool.register(p[1], b"h1")
    pool.release(p)
    pool.end_step()
    assert pool.take(1) == [p[1]]  # evicts h1 (the tail) into host page 0
    off, load = pool.end_step()
    assert off == [(p[1], 0)] and load == []
    hit = pool.match([b"h0", b"h1"])
    assert hit.device == (p[0],) and hit.host == (0,)
    pool.release([p[1]])  # nobody registered new content there: free again
    pool.acquire(hit.device)
    pages = pool.load(hit.host, [b"h1"])
    assert pages == [p[1]] and pool.match([b"h0", b"h1"]).device == (p[0], p[1])
    off, load = pool.end_step()
    assert load == [(0, p[1])] and off == []
    assert pool.host_pages_used() == 0
    # a full host tier drops its least recently used page for a newer one
    pool2 = PagePool(1, num_host_pages=1)
    for h in (b"a", b"b"):
        (q,) = pool2.take(1)
        pool2.register(q, h)
        pool2.release([q])
    assert pool2.take(1) == [0]
    assert pool2.match([b"a"]).host == () and pool2.match([b"b"]).host == (0,)


def test_state_pool_lru_reserve_commit_cancel() -> None:
    st = StatePool([10, 11])
    s1, s2 = st.reserve(), st.reserve()
    assert {s1, s2} == {10, 11}
    st.commit(b"p", s1)
    st.commit(b"q", s2)
    assert st.get(b"p") == s1  # touch p: q is now the least recently used
    assert st.reserve() == s2 and not st.has(b"q") and st.num_evicted == 1
    st.cancel(s2)
    s3 = st.reserve()
    st.commit(b"p", s3)  # duplicate content: the slot goes back
    assert st.num_blocks == 1 and st.reserve() == s3


def _req(rid: str, ids: list[int], max_tokens: int = 3) -> Request:
    return Request(rid, ids, max_tokens=max_tokens)


def _kv(mode: str = "exact", *, pages: int = 16, host: int = 0, states: int = 4) -> KVCacheManager:
    return KVCacheManager(page_size=4, num_pages=pages, num_slots=2, prefix=PrefixCaching(
        mode=mode, window=4, num_host_pages=host, state_slots=tuple(range(2, 2 + states))))


def _compute(kv: KVCacheManager, req: Request, n: int) -> None:
    """Schedule and commit one chunk of n tokens (what scheduler + runner do)."""
    start = req.num_computed_tokens
    assert kv.allocate(req, n)
    kv.plan_step(req, start, start + n)
    req.num_computed_tokens += n
    kv.commit(req)


def test_exact_hit_needs_a_state_block_and_restores_it() -> None:
    kv = _kv()
    a = _req("a", list(range(11)))
    _compute(kv, a, 11)  # pages 0, 1 full; captures at 4 and 8 (latest first)
    ops = kv.take_ops()
    assert [(c.position, c.dest) for c in ops.captures] == [(8, 2), (4, 3)]
    assert [(f.slot, f.window_floor, f.write_floor) for f in ops.floors] == [(0, 0, 0)]
    kv.free(a)
    b = _req("b", list(range(10)) + [50, 51])
    hit = kv.lookup(b)
    assert (hit.num_cached_tokens, hit.start, hit.state_slot, hit.pages.device) == (8, 8, 2, (0, 1))
    b.num_computed_tokens = hit.start
    assert kv.allocate(b, 4, hit=hit)
    assert kv.page_ids("b")[:2] == [0, 1] and kv.pool.refcount(0) == 1
    ops = kv.take_ops()
    assert ops.restore == ((2, kv.slot("b"), 8),)
    assert ops.history[0].position == 8 and ops.history[0].ids == tuple(range(8))
    # without a state block at the last cached page the hit falls back to an earlier boundary, then to none
    kv2 = _kv(states=0)
    c = _req("c", list(range(9)))
    _compute(kv2, c, 9)
    assert kv2.lookup(_req("d", list(range(10)))) is None


def test_approximate_hit_replays_a_window_and_floors() -> None:
    kv = _kv("approximate")
    a = _req("a", list(range(13)))
    _compute(kv, a, 13)
    kv.take_ops()
    b = _req("b", list(range(13)) + [7])
    hit = kv.lookup(b)  # 3 pages = 12 tokens cached, replay min(12, window 4)
    assert (hit.num_cached_tokens, hit.start, hit.num_replayed_tokens, hit.state_slot) == (12, 8, 4, None)
    b.num_computed_tokens = hit.start
    assert kv.allocate(b, 14 - 8, hit=hit)
    assert kv.page_ids("b")[:3] == kv.page_ids("a")[:3] and len(kv.page_ids("b")) == 4
    ops = kv.take_ops()
    assert [(f.window_floor, f.write_floor) for f in ops.floors] == [(8, 12)] and not ops.restore
    assert kv.stats.hits == 1 and kv.stats.replayed_tokens == 4
    # a hit no longer than the window would replay everything: none
    assert kv.lookup(_req("c", [0, 1, 2, 3, 9])) is None


def test_hit_allocation_is_all_or_nothing_and_eviction_spares_hit_pages() -> None:
    kv = _kv(pages=4)
    a = _req("a", list(range(9)))
    _compute(kv, a, 9)  # 3 pages
    kv.free(a)  # pages 0, 1 cached (page 2 partial: free)
    kv.take_ops()
    b = _req("b", list(range(8)) + list(range(60, 72)))
    hit = kv.lookup(b)
    assert hit.num_cached_tokens == 8
    b.num_computed_tokens = 8
    assert not kv.allocate(b, 12, hit=hit)  # 2 hit + 3 new > 4 pages
    assert kv.pool.is_evictable(0) and kv.pool.is_evictable(1) and "b" not in kv._pages
    assert kv.allocate(b, 8, hit=hit)  # 2 hit + 2 new: the free ones, never the hit pages
    assert kv.page_ids("b")[:2] == [0, 1] and kv.num_free_pages == 0


def test_host_tier_round_trip_through_the_manager() -> None:
    kv = _kv(pages=3, host=4, states=8)
    a = _req("a", list(range(9)))
    _compute(kv, a, 9)
    kv.free(a)
    kv.take_ops()
    other = _req("o", list(range(50, 62)))
    _compute(kv, other, 12)  # needs all 3 pages: the cached ones go to the host tier
    ops = kv.take_ops()
    assert sorted(p for p, _ in ops.offload) == [0, 1]
    kv.free(other)
    b = _req("b", list(range(9)) + [5])
    hit = kv.lookup(b)
    assert hit is not None and hit.pages.host and hit.num_cached_tokens == 8
    b.num_computed_tokens = hit.start
    assert kv.allocate(b, 2, hit=hit)
    ops = kv.take_ops()
    assert len(ops.load) == len(hit.pages.host) and kv.stats.host_loaded_pages == len(hit.pages.host)


def test_plan_counts_state_slots_against_the_budget() -> None:
    fams = [CacheFamily(name="p", kind="paged", num_layers=1, bytes_per_token=10.0),
            CacheFamily(name="s", kind="slot", num_layers=1, bytes_per_slot=1000)]
    base = plan_cache(fams, page_size=4, memory_bytes=20_000, max_num_seqs=4, max_model_len=4000)
    more = plan_cache(fams, page_size=4, memory_bytes=20_000, max_num_seqs=4, max_model_len=4000,
                      num_state_slots=3)
    assert more.num_pages == base.num_pages - 3 * 1000 // 40 and more.total_bytes <= 20_000


@pytest.mark.parametrize("mode", ["exact", "approximate"])
def test_scheduler_shares_a_prefix_computed_in_the_same_step(mode: str) -> None:
    kv = KVCacheManager(page_size=4, num_pages=32, num_slots=4, prefix=PrefixCaching(
        mode=mode, window=4, state_slots=(4, 5, 6, 7)))
    s = Scheduler(kv=kv, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    prompt = list(range(20, 37))  # 17 tokens: 4 full pages
    for rid in "abc":
        s.add_request(Request(rid, prompt, max_tokens=2))
    s.add_request(Request("z", [1, 2, 3], max_tokens=2))  # unrelated: not held back
    out = s.schedule()
    assert [c.req_id for c in out.chunks] == ["a", "z"]
    s.update_from_output(out, ModelRunnerOutput(sampled_token_ids={"a": 5, "z": 6}))
    out = s.schedule()
    starts = {c.req_id: c.start_position for c in out.chunks}
    assert starts["b"] == starts["c"] == (16 if mode == "exact" else 12)
    reqs = {r: s.get_request(r) for r in "bc"}
    assert all(r.num_cached_tokens == 16 for r in reqs.values())
    assert kv.page_ids("b")[:4] == kv.page_ids("a")[:4] == kv.page_ids("c")[:4]


def test_fork_clones_the_live_slot_shares_full_pages_and_copies_the_partial_one() -> None:
    kv = KVCacheManager(page_size=4, num_pages=16, num_slots=3, prefix=PrefixCaching(
        mode="exact", window=4, max_fork_rollback=2))
    a = _req("a", list(range(10)))
    _compute(kv, a, 10)
    kv.take_ops()
    b = _req("b", list(range(10)))  # same prompt: resume at 9 (its last token is computed for its logits)
    src, f = kv.fork_point(b, [a])
    assert src is a and f == 9
    assert kv.fork_point(_req("c", list(range(6)) + [99, 98]), [a]) is None  # diverges 4 behind a's progress
    b.num_computed_tokens = f
    assert kv.allocate_fork(b, a, f, 1)
    pa, pb = kv.page_ids("a"), kv.page_ids("b")
    assert pb[:2] == pa[:2] and pb[2] != pa[2] and kv.pool.refcount(pa[0]) == 2
    ops = kv.take_ops()
    assert ops.clone_slots == ((kv.slot("a"), kv.slot("b"), 10),) and ops.copy_pages == ((pa[2], pb[2]),)
    assert kv.stats.forks == 1 and kv.stats.cached_tokens == 9


def test_fork_never_resumes_below_the_sources_resume_floor() -> None:
    """A source whose slot was placed at position 8 (a resumed hit) holds nothing a step at F < 8 reads: a
    request sharing only its first token must not fork from it however large the rollback budget; a fork of
    that source inherits its floor. (A preempting n = 2 run gave a wrong first token before floors existed.)"""
    kv = KVCacheManager(page_size=4, num_pages=16, num_slots=3, prefix=PrefixCaching(
        mode="exact", window=4, max_fork_rollback=9))
    a = _req("a", [0] + list(range(40, 48)))
    a.num_computed_tokens = 8  # placed at 8, as after a state-block restore
    _compute(kv, a, 1)
    kv.take_ops()
    assert kv.fork_point(_req("x", [0, 300, 301]), [a]) is None  # F = 1 < floor 8
    b = _req("b", [0] + list(range(40, 48)) + [7])
    src, f = kv.fork_point(b, [a])
    assert src is a and f == 9
    b.num_computed_tokens = f
    assert kv.allocate_fork(b, a, f, 1)
    b.num_computed_tokens += 1
    c = _req("c", [0] + list(range(40, 47)) + [5, 6])
    assert kv.fork_point(c, [b]) == (b, 8)  # shares 8 tokens: F = 8 is b's inherited floor, allowed
    d = _req("d", [0] + list(range(40, 46)) + [5, 6])
    assert kv.fork_point(d, [b]) is None  # shares 7: F = 7 is below it
