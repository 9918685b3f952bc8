"""Cache manager: a slot pool (per-sequence families) and a page pool (paged families), sized from a byte budget.

Pure Python (no torch): it hands out slot ids and page ids; the model's `ModelCache` owns the tensors.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer_engine.core.kv_cache_spec import CacheFamily
from deepinfer_engine.core.request import Request
from deepinfer_engine.errors import CapacityError

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class CachePlan:
    """Numbers derived at start-up from the cache families and the budget (logged once, never written back)."""

    page_size: int
    num_slots: int
    num_pages: int
    bytes_per_slot: int
    bytes_per_page: int
    bytes_per_token: float
    families: tuple[CacheFamily, ...]

    @property
    def total_bytes(self) -> int:
        return self.num_slots * self.bytes_per_slot + self.num_pages * self.bytes_per_page

    @property
    def max_cached_tokens(self) -> int:
        return self.num_pages * self.page_size

    def describe(self) -> list[str]:
        lines = []
        for f in self.families:
            if f.kind == "paged":
                lines.append(f"cache family {f.name}: paged, {f.num_layers} layer(s), {f.bytes_per_token:g} B/token")
            else:
                lines.append(f"cache family {f.name}: per-sequence, {f.num_layers} layer(s), {f.bytes_per_slot} B/slot")
        lines.append(
            f"cache plan: {self.bytes_per_token:g} B/token paged, page {self.page_size} tokens = "
            f"{self.bytes_per_page} B; {self.bytes_per_slot} B/sequence; {self.num_slots} slots, "
            f"{self.num_pages} pages ({self.max_cached_tokens} tokens), {self.total_bytes / 2**20:.2f} MiB"
        )
        return lines


def plan_cache(
    families: Sequence[CacheFamily],
    *,
    page_size: int,
    memory_bytes: int | None,
    max_num_seqs: int,
    max_model_len: int,
    num_pages: int | None = None,
    num_slots: int | None = None,
) -> CachePlan:
    """Split a byte budget into sequence slots and pages.

    Slots are capped by `max_num_seqs` and by giving every slot at least one page; the rest becomes pages.
    Pages beyond num_slots * ceil(max_model_len / page_size) are never allocated (they could not be used).
    `num_pages` / `num_slots` override the derived counts (tests force preemption with them). A model without
    paged families still gets page bookkeeping (0 bytes), sized for `max_num_seqs` full-length sequences.
    """
    if page_size <= 0:
        raise CapacityError(f"page_size: must be > 0, got {page_size}")
    per_token = float(sum(f.bytes_per_token for f in families if f.kind == "paged"))
    per_slot = int(sum(f.bytes_per_slot for f in families if f.kind == "slot"))
    per_page = math.ceil(per_token * page_size)
    full_len_pages = math.ceil(max_model_len / page_size)
    if num_slots is None:
        if memory_bytes is None:
            num_slots = max_num_seqs
        else:
            num_slots = min(max_num_seqs, memory_bytes // max(1, per_slot + per_page))
    if num_pages is None:
        if per_page == 0 or memory_bytes is None:
            num_pages = max(1, num_slots) * full_len_pages
        else:
            # more pages than every slot filled to max_model_len is memory that can never be used
            num_pages = min((memory_bytes - num_slots * per_slot) // per_page, max(1, num_slots) * full_len_pages)
    if num_slots < 1 or num_pages < 1:
        need = per_slot + per_page
        raise CapacityError(
            f"kv_cache_memory_bytes: {memory_bytes} B cannot hold one sequence slot ({per_slot} B) and one "
            f"{page_size}-token page ({per_page} B); give at least {need} B (one full-length sequence of "
            f"{max_model_len} tokens needs {per_slot + full_len_pages * per_page} B)"
        )
    return CachePlan(
        page_size=page_size,
        num_slots=int(num_slots),
        num_pages=int(num_pages),
        bytes_per_slot=per_slot,
        bytes_per_page=per_page,
        bytes_per_token=per_token,
        families=tuple(families),
    )


class KVCacheManager:
    """Slot ids and page ids per request. A request holds one slot while it has any cached state and
    ceil(num_cached_tokens / page_size) pages (its block table, in order)."""

    def __init__(self, *, page_size: int, num_pages: int, num_slots: int) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        # pop() from the end: lowest ids first, for readable logs/tests
        self._free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self._pages: dict[str, list[int]] = {}
        self._slots: dict[str, int] = {}

    @classmethod
    def from_plan(cls, plan: CachePlan) -> KVCacheManager:
        return cls(page_size=plan.page_size, num_pages=plan.num_pages, num_slots=plan.num_slots)

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self.num_pages

    def slot(self, request_id: str) -> int:
        return self._slots[request_id]

    def page_ids(self, request_id: str) -> list[int]:
        return self._pages.get(request_id, [])

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens`.

        All or nothing: returns False (and changes nothing) when a slot or enough pages are not free.
        """
        rid = request.request_id
        have = self._pages.get(rid, [])
        need = self.pages_for(request.num_computed_tokens + num_new_tokens) - len(have)
        need_slot = rid not in self._slots
        if need > len(self._free_pages) or (need_slot and not self._free_slots):
            return False
        if need_slot:
            self._slots[rid] = self._free_slots.pop()
        if need > 0:
            self._pages[rid] = have + [self._free_pages.pop() for _ in range(need)]
        elif rid not in self._pages:
            self._pages[rid] = have
        return True

    def free(self, request: Request) -> None:
        rid = request.request_id
        pages = self._pages.pop(rid, [])
        self._free_pages.extend(reversed(pages))
        slot = self._slots.pop(rid, None)
        if slot is not None:
            self._free_slots.append(slot)

    def usage(self) -> float:
        return 1.0 - len(self._free_pages) / self.num_pages if self.num_pages else 0.0
