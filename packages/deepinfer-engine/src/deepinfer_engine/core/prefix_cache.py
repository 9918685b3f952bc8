"""Prefix cache bookkeeping (docs/prefix_cache.md): content hashes of full pages, reference counts, an LRU of
cached pages no running request holds, a host-memory tier for evicted pages, and exact-replay state blocks.
Pure Python: it hands out ids and records the copies the model runner must make; it never touches tensors.

A page is in exactly one of: the free list (no content worth keeping), held (refcount > 0, in the block table of
at least one running request), or evictable (refcount 0 but its hash is registered: an LRU entry). Only free and
evictable pages are ever handed out; a held page is never evicted.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["PageHit", "PagePool", "StatePool", "block_hash", "block_hashes"]


def block_hash(parent: bytes | None, token_ids: Sequence[int], extra: bytes = b"") -> bytes:
    """sha256 of (parent hash, the page's token ids as int64, extra): a page's content depends on every token
    before it (through the parent chain) and on anything else that changes it (`extra`, e.g. image content ids)."""
    h = hashlib.sha256()
    h.update(parent or b"\x00" * 32)
    h.update(array("q", token_ids).tobytes())
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    return h.digest()


def block_hashes(token_ids: Sequence[int], page_size: int, *, parent: bytes | None = None,
                 extra: bytes = b"") -> list[bytes]:
    """Hashes of every full page of `token_ids` (a partial tail page has none), chained from `parent`."""
    out: list[bytes] = []
    for k in range(len(token_ids) // page_size):
        parent = block_hash(parent, token_ids[k * page_size : (k + 1) * page_size], extra)
        out.append(parent)
    return out


@dataclass(frozen=True, kw_only=True)
class PageHit:
    """Longest cached chain of a request's full pages: `device` page ids first, then `host` page ids whose
    content must be loaded back (the chain continues on the host tier)."""

    device: tuple[int, ...]
    host: tuple[int, ...]

    @property
    def num_pages(self) -> int:
        return len(self.device) + len(self.host)


class PagePool:
    """Device pages with content hashes, refcounts and LRU eviction, plus the optional host tier.

    `num_host_pages` > 0: an evicted cached page is copied to a host page (offload op) instead of being dropped,
    and a later hit brings it back (load op). Host pages are LRU too; a host page whose content was loaded back
    is reused only from the next step on (its load may still be pending in the step that freed it).
    """

    def __init__(self, num_pages: int, *, caching: bool = True, num_host_pages: int = 0) -> None:
        self.num_pages = num_pages
        self.caching = caching
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # pop() -> lowest id first
        self._ref = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}
        self._page_of: dict[bytes, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # LRU first
        self.num_host_pages = num_host_pages
        self._host_free: list[int] = list(range(num_host_pages - 1, -1, -1))
        self._host_of: OrderedDict[bytes, int] = OrderedDict()  # LRU first
        self._host_deferred: list[int] = []
        self.offloads: list[tuple[int, int]] = []  # ops of the step being scheduled
        self.loads: list[tuple[int, int]] = []
        self.num_evicted = 0
        self.num_offloaded = 0

    # ---------------------------------------------------------------------------------------------- counts
    @property
    def num_free(self) -> int:
        """Pages that can be handed out now (free or evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._page_of)

    def refcount(self, page: int) -> int:
        return self._ref[page]

    def is_evictable(self, page: int) -> bool:
        return page in self._evictable

    def host_pages_used(self) -> int:
        return len(self._host_of)

    def hash_of(self, page: int) -> bytes | None:
        return self._hash_of.get(page)

    # ---------------------------------------------------------------------------------------------- lookup
    def match(self, hashes: Sequence[bytes]) -> PageHit:
        """The longest prefix of `hashes` that is cached (device first; once the chain leaves the device it may
        continue on the host tier, never back)."""
        dev: list[int] = []
        host: list[int] = []
        for h in hashes:
            if not host and h in self._page_of:
                dev.append(self._page_of[h])
            elif h in self._host_of:
                host.append(self._host_of[h])
            else:
                break
        return PageHit(device=tuple(dev), host=tuple(host))

    # ---------------------------------------------------------------------------------------------- hand out
    def _evict_one(self) -> int:
        page, _ = self._evictable.popitem(last=False)
        h = self._hash_of.pop(page)
        del self._page_of[h]
        self.num_evicted += 1
        if self.num_host_pages and h not in self._host_of:
            slot = self._host_slot()
            if slot is not None:
                self._host_of[h] = slot
                self.offloads.append((page, slot))
                self.num_offloaded += 1
        return page

    def _host_slot(self) -> int | None:
        if self._host_free:
            return self._host_free.pop()
        if self._host_of:
            _, slot = self._host_of.popitem(last=False)
            return slot
        return None

    def take(self, n: int) -> list[int] | None:
        """n pages with refcount 1 (free ones first, then the least recently used evictable ones); None and no
        change when fewer than n are available."""
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            page = self._free.pop() if self._free else self._evict_one()
            self._ref[page] = 1
            out.append(page)
        return out

    def acquire(self, pages: Sequence[int]) -> None:
        """One more reference to each of these cached pages (a hit)."""
        for p in pages:
            self._evictable.pop(p, None)
            self._ref[p] += 1

    def load(self, host_pages: Sequence[int], hashes: Sequence[bytes]) -> list[int] | None:
        """Device pages (refcount 1, hashes registered) for host pages of a hit, with their load ops; None when
        not enough device pages are available."""
        pages = self.take(len(host_pages))
        if pages is None:
            return None
        for hp, h, page in zip(host_pages, hashes, pages):
            self.loads.append((hp, page))
            del self._host_of[h]
            self._host_deferred.append(hp)
            self._register(page, h)
        return pages

    def release(self, pages: Sequence[int]) -> None:
        """Drop one reference to each page of a block table; a page nobody holds becomes evictable (cached) or
        free. Tail pages enter the LRU first, so a chain loses its end before its start."""
        for p in reversed(pages):
            self._ref[p] -= 1
            if self._ref[p] > 0:
                continue
            if p in self._hash_of:
                self._evictable[p] = None
                self._evictable.move_to_end(p)
            else:
                self._free.append(p)

    def _register(self, page: int, h: bytes) -> None:
        self._hash_of[page] = h
        self._page_of[h] = page

    def register(self, page: int, h: bytes) -> bool:
        """Record that a held page now holds the content of hash `h` (its tokens were computed). False when
        another page already holds that content (this one stays unshared and is freed normally)."""
        if not self.caching or h in self._page_of or page in self._hash_of:
            return False
        self._register(page, h)
        return True

    def end_step(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The step's (offload, load) ops; host pages freed by this step's loads become reusable."""
        ops = (self.offloads, self.loads)
        self.offloads, self.loads = [], []
        self._host_free.extend(self._host_deferred)
        self._host_deferred = []
        return ops

    def reset_cache(self) -> None:
        """Forget every cached hash (device and host); held pages stay held."""
        for p in list(self._evictable):
            self._free.append(p)
        self._evictable.clear()
        self._hash_of.clear()
        self._page_of.clear()
        self._host_free.extend(self._host_of.values())
        self._host_of.clear()


class StatePool:
    """Exact-replay state blocks: slots of the slot families holding the ring rows a step starting at a page
    boundary reads, keyed by the hash of the page that ends there. LRU; a slot reserved for a capture in the
    step being run is not evictable until it is committed or cancelled."""

    def __init__(self, slots: Sequence[int]) -> None:
        self._free = list(reversed(slots))
        self._by_hash: OrderedDict[bytes, int] = OrderedDict()
        self.num_slots = len(slots)
        self.num_evicted = 0

    def get(self, h: bytes) -> int | None:
        slot = self._by_hash.get(h)
        if slot is not None:
            self._by_hash.move_to_end(h)
        return slot

    def has(self, h: bytes) -> bool:
        return h in self._by_hash

    def reserve(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._by_hash:
            _, slot = self._by_hash.popitem(last=False)
            self.num_evicted += 1
            return slot
        return None

    def commit(self, h: bytes, slot: int) -> None:
        if h in self._by_hash:
            self._free.append(slot)
        else:
            self._by_hash[h] = slot

    def cancel(self, slot: int) -> None:
        self._free.append(slot)

    @property
    def num_blocks(self) -> int:
        return len(self._by_hash)

    def reset(self) -> None:
        self._free.extend(self._by_hash.values())
        self._by_hash.clear()
