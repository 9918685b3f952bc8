"""Cache manager: a slot pool (per-sequence families) and a page pool (paged families), sized from a byte budget.

Pure Python (no torch): it hands out slot ids and page ids; the model's `ModelCache` owns the tensors.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from deepinfer_engine.core.cache_ops import CacheOps, Capture, ReplayFloor, TokenHistory
from deepinfer_engine.core.kv_cache_spec import CacheFamily
from deepinfer_engine.core.prefix_cache import PageHit, PagePool, StatePool, block_hash
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
    num_state_slots: int = 0  # extra slots holding exact prefix-replay state blocks (docs/prefix_cache.md)

    @property
    def total_bytes(self) -> int:
        return (self.num_slots + self.num_state_slots) * self.bytes_per_slot + self.num_pages * self.bytes_per_page

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
            f"{self.num_pages} pages ({self.max_cached_tokens} tokens), "
            + (f"{self.num_state_slots} prefix state slots, " if self.num_state_slots else "")
            + f"{self.total_bytes / 2**20:.2f} MiB"
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
    num_state_slots: int = 0,
) -> CachePlan:
    """Split a byte budget into sequence slots and pages.

    Slots are capped by `max_num_seqs` and by giving every slot at least one page; the rest becomes pages.
    Pages beyond num_slots * ceil(max_model_len / page_size) are never allocated (they could not be used).
    `num_pages` / `num_slots` override the derived counts (tests force preemption with them). A model without
    paged families still gets page bookkeeping (0 bytes), sized for `max_num_seqs` full-length sequences.
    `num_state_slots` extra slots (exact prefix-replay state blocks) are charged against the budget before the
    pages.
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
            num_pages = min((memory_bytes - (num_slots + num_state_slots) * per_slot) // per_page,
                            max(1, num_slots) * full_len_pages)
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
        num_state_slots=int(num_state_slots),
    )


@dataclass(frozen=True, kw_only=True)
class PrefixCaching:
    """How the cache manager shares pages between requests (docs/prefix_cache.md).

    mode: "exact" (a hit resumes at a page boundary that has a state block: outputs equal a full recompute) or
    "approximate" (a hit of h tokens replays r = min(h, window) tokens whose window is floored at the replay
    start). window: the model's sliding window. num_host_pages: host tier size in pages (0 = off).
    state_slots: slot ids (beyond the running slots) that hold exact-replay state blocks.
    """

    mode: Literal["exact", "approximate"] = "exact"
    window: int
    num_host_pages: int = 0
    state_slots: tuple[int, ...] = ()
    # forks (a request sharing a running request's computed prefix): the deepest rollback the slot rings
    # allow (the cache's slack + 1); 0 = no forks
    max_fork_rollback: int = 0
    # prefill truncation: the decoder rings of a prefill hold only its last rows, so state blocks are taken only
    # where a chunk stops (never inside a truncated forward) at boundaries at least window - 1 rows into the
    # kept tail: b >= known tokens - capture_tail; None = everywhere
    capture_tail: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("exact", "approximate"):
            raise ValueError(f"prefix_replay: found {self.mode!r}, expected exact or approximate")


@dataclass(frozen=True, kw_only=True)
class PrefixHit:
    """A request's cached prefix: `num_cached_tokens` = h (page-aligned) tokens whose pages come from the cache;
    computing resumes at `start` = h - r (r replayed tokens); `state_slot` the exact-replay state block."""

    num_cached_tokens: int
    start: int
    pages: PageHit
    hashes: tuple[bytes, ...]
    state_slot: int | None

    @property
    def num_replayed_tokens(self) -> int:
        return self.num_cached_tokens - self.start


@dataclass(kw_only=True)
class PrefixStats:
    queries: int = 0  # requests looked up
    query_tokens: int = 0  # prompt tokens of those requests
    hits: int = 0
    cached_tokens: int = 0
    replayed_tokens: int = 0
    host_loaded_pages: int = 0
    forks: int = 0  # hits served by cloning a running request's state (shared prefixes inside a batch)

    @property
    def hit_rate(self) -> float:
        """Fraction of looked-up prompt tokens served from the cache."""
        return self.cached_tokens / self.query_tokens if self.query_tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"prefix_queries": self.queries, "prefix_query_tokens": self.query_tokens, "prefix_hits": self.hits,
                "prefix_cached_tokens": self.cached_tokens, "prefix_replayed_tokens": self.replayed_tokens,
                "prefix_host_loaded_pages": self.host_loaded_pages, "prefix_forks": self.forks,
                "prefix_hit_rate": self.hit_rate}


# token ids of the positions before a resume point handed to the runner (the Engram n-gram history needs
# max_ngram_size - 1 = 3 of them on V4.1; ModelCache checks that its token ring needs no more)
HISTORY_IDS = 8


class KVCacheManager:
    """Slot ids and page ids per request. A request holds one slot while it has any cached state and
    ceil(num_cached_tokens / page_size) pages (its block table, in order).

    With `prefix` set, full pages are content-hashed once their tokens are computed (`commit`), shared between
    requests through `lookup` / `allocate(hit=...)`, and kept after their requests finish until the memory is
    needed (LRU, never a page a running request holds); the copies this implies are collected per step as
    `CacheOps` (`take_ops`).
    """

    def __init__(self, *, page_size: int, num_pages: int, num_slots: int, prefix: PrefixCaching | None = None) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.prefix = prefix
        self._pool = PagePool(num_pages, caching=prefix is not None,
                              num_host_pages=prefix.num_host_pages if prefix is not None else 0)
        self._states = StatePool(prefix.state_slots if prefix is not None and prefix.mode == "exact" else ())
        # pop() from the end: lowest ids first, for readable logs/tests
        self._free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        self._pages: dict[str, list[int]] = {}
        self._slots: dict[str, int] = {}
        self._hashes: dict[str, list[bytes]] = {}  # full-page hashes of each request's tokens (grown lazily)
        self._registered: dict[str, int] = {}  # leading pages of the table known to the cache
        # per request with a slot: the lowest position its slot state can resume at. A slot filled from a state
        # block or a token history at s holds only what a step at s reads, not the rows a rollback below s
        # would; a fork inherits its source's floor (its rows below F are the source's)
        self._resume_floor: dict[str, int] = {}
        self._pending: dict[str, list[tuple[int, int]]] = {}  # (page index, state slot) captured this step
        self._inflight: set[bytes] = set()  # hashes of pages being computed in the step being scheduled
        self._ops: dict[str, list] = {k: [] for k in ("restore", "history", "floors", "captures", "clone", "copy")}
        self._snapshots_next: list[tuple[int, int, int]] = []  # planned this step, applied before the next
        self._snapshots_due: list[tuple[int, int, int]] = []
        self.stats = PrefixStats()

    @classmethod
    def from_plan(cls, plan: CachePlan, prefix: PrefixCaching | None = None) -> KVCacheManager:
        return cls(page_size=plan.page_size, num_pages=plan.num_pages, num_slots=plan.num_slots, prefix=prefix)

    @property
    def num_free_pages(self) -> int:
        """Pages that can be handed out (free, or cached by no running request)."""
        return self._pool.num_free

    @property
    def num_free_slots(self) -> int:
        return len(self._free_slots)

    @property
    def pool(self) -> PagePool:
        return self._pool

    @property
    def state_pool(self) -> StatePool:
        return self._states

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.pages_for(num_tokens) <= self.num_pages

    def slot(self, request_id: str) -> int:
        return self._slots[request_id]

    def page_ids(self, request_id: str) -> list[int]:
        return self._pages.get(request_id, [])

    # ------------------------------------------------------------------------------------------ prefix lookup
    def _hashes_upto(self, req: Request, num_blocks: int) -> list[bytes]:
        hs = self._hashes.setdefault(req.request_id, [])
        P = self.page_size
        while len(hs) < num_blocks:
            k = len(hs)
            hs.append(block_hash(hs[-1] if hs else None, req.token_slice(k * P, (k + 1) * P)))
        return hs

    def lookup(self, req: Request) -> PrefixHit | None:
        """The longest usable cached prefix of a request that holds no pages yet (None: compute from 0).

        At most (num_tokens - 1) // page_size pages: the last token is always computed (its logits are needed).
        exact: the longest cached chain whose last page boundary has a state block; resume there, replay 0.
        approximate: the longest cached chain h; resume at h - min(h, window) (a hit that would replay
        everything is no hit)."""
        if self.prefix is None or req.request_id in self._pages or not req.use_prefix_cache:
            return None
        hashes = self._hashes_upto(req, (req.num_tokens - 1) // self.page_size)
        found = self._pool.match(hashes)
        j, state = found.num_pages, None
        if self.prefix.mode == "exact":
            while j > 0 and not self._states.has(hashes[j - 1]):
                j -= 1
            if j > 0:
                state = self._states.get(hashes[j - 1])
        h = j * self.page_size
        start = h if self.prefix.mode == "exact" else h - min(h, self.prefix.window)
        if j == 0 or start == 0:
            return None
        nd = min(j, len(found.device))
        pages = PageHit(device=found.device[:nd], host=found.host[: j - nd])
        return PrefixHit(num_cached_tokens=h, start=start, pages=pages, hashes=tuple(hashes[:j]), state_slot=state)

    def waits_for_inflight(self, req: Request) -> bool:
        """True when the first page of `req` that is not cached is being computed in this step by another
        request: admitting it next step shares that page instead of computing it twice."""
        if self.prefix is None or not self._inflight or not req.use_prefix_cache:
            return False
        hashes = self._hashes_upto(req, (req.num_tokens - 1) // self.page_size)
        k = self._pool.match(hashes).num_pages
        return k < len(hashes) and hashes[k] in self._inflight

    def fork_point(self, req: Request, running: Sequence[Request], *, after: int = 0) -> tuple[Request, int] | None:
        """A running request whose live state `req` can start from, and the position F to resume at (> after).
        `running` must only hold requests whose slot holds what they computed (not ones placed this step).

        The source must have computed at least F tokens that equal req's first F, with F at most
        `max_fork_rollback` behind its progress (its rings still hold every row a step at F reads), not below
        the position its slot state was placed at (a state block or token history holds nothing older) and at
        most req.num_tokens - 1. The fork clones the source's slot, shares its full pages below F and copies the
        page F falls in."""
        if (self.prefix is None or not self.prefix.max_fork_rollback or req.request_id in self._pages
                or not req.use_prefix_cache):
            return None
        toks = req.all_token_ids
        best: tuple[Request, int] | None = None
        for src in running:
            c = src.num_computed_tokens
            if src.request_id not in self._slots or c == 0:
                continue
            if self.prefix.capture_tail is not None and c < src.num_prompt_tokens:
                continue  # mid-prefill under truncation: its decoder rings hold nothing yet
            lo = max(after + 1, c - self.prefix.max_fork_rollback, self._resume_floor.get(src.request_id, 0),
                     best[1] + 1 if best else 0)
            hi = min(c, req.num_tokens - 1, src.num_tokens)  # async scheduling: c may count an unreturned sample
            if hi < lo:
                continue
            theirs = src.token_slice(0, hi)
            if toks[:lo] != theirs[:lo]:
                continue
            f = lo
            while f < hi and toks[f] == theirs[f]:
                f += 1
            best = (src, f)
        return best

    def allocate_fork(self, req: Request, src: Request, position: int, num_new_tokens: int) -> bool:
        """Start `req` at `position` from `src`'s live state (see fork_point): all or nothing."""
        rid, P = req.request_id, self.page_size
        if rid in self._pages or not self._free_slots:
            return False
        shared = self._pages[src.request_id][: position // P]
        partial = position % P != 0
        total = max(len(shared) + partial, self.pages_for(position + num_new_tokens))
        new = self._pool.take(total - len(shared))
        if new is None:
            return False
        self._pool.acquire(shared)
        self._pages[rid] = list(shared) + new
        self._registered[rid] = len(shared)
        slot = self._slots[rid] = self._free_slots.pop()
        self._resume_floor[rid] = self._resume_floor.get(src.request_id, 0)
        src_slot = self._slots[src.request_id]
        self._ops["clone"].append((src_slot, slot, src.num_computed_tokens))
        if partial:
            self._ops["copy"].append((self._pages[src.request_id][position // P], new[0]))
        self._ops["floors"].append(ReplayFloor(slot=slot))
        st = self.stats
        st.queries += 1
        st.query_tokens += req.num_prompt_tokens
        st.hits += 1
        st.cached_tokens += position
        st.forks += 1
        return True

    # ------------------------------------------------------------------------------------------ allocation
    def allocate(self, request: Request, num_new_tokens: int, *, hit: PrefixHit | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after `request.num_computed_tokens` (= hit.start with a
        hit, whose pages then open the block table).

        All or nothing: returns False (and changes nothing) when a slot or enough pages are not available.
        """
        rid = request.request_id
        have = self._pages.get(rid, [])
        need_slot = rid not in self._slots
        if need_slot and not self._free_slots:
            return False
        if hit is not None:
            if have:
                raise ValueError(f"allocate: request {rid!r} already holds pages, a prefix hit cannot apply")
            total = max(hit.pages.num_pages, self.pages_for(request.num_computed_tokens + num_new_tokens))
            fresh = total - hit.pages.num_pages
            held = sum(1 for p in hit.pages.device if self._pool.is_evictable(p))
            if len(hit.pages.host) + fresh > self._pool.num_free - held:
                return False
            self._pool.acquire(hit.pages.device)
            loaded = self._pool.load(hit.pages.host, hit.hashes[len(hit.pages.device) :])
            new = self._pool.take(fresh)
            assert loaded is not None and new is not None  # counted above
            self._pages[rid] = list(hit.pages.device) + loaded + new
            self._registered[rid] = hit.pages.num_pages
        else:
            need = self.pages_for(request.num_computed_tokens + num_new_tokens) - len(have)
            if need > 0 or rid not in self._pages:  # most decode steps fit the pages held: nothing to change
                new = self._pool.take(max(0, need))
                if new is None:
                    return False
                self._pages[rid] = have + new
        if need_slot:
            slot = self._slots[rid] = self._free_slots.pop()
            self._resume_floor[rid] = request.num_computed_tokens
            if self.prefix is not None:
                self.stats.queries += 1
                self.stats.query_tokens += request.num_prompt_tokens
                self._placed(request, slot, hit)
        return True

    def admit(self, req: Request, running: Sequence[Request], chunk_len: Callable[[Request], int | None]
              ) -> int | None:
        """Place a waiting request: start it from a running request's live state (fork), a cached prefix, or
        its beginning, whichever reaches furthest, and allocate its first chunk (`chunk_len(req)` tokens from
        that start; None = does not fit). Returns the chunk length, or None with nothing changed."""
        fresh = req.num_computed_tokens == 0
        hit = self.lookup(req) if fresh else None
        fork = self.fork_point(req, running, after=hit.start if hit else 0) if fresh else None
        if fork is not None:
            hit = None
            req.num_computed_tokens = fork[1]
        elif hit is not None:
            req.num_computed_tokens = hit.start
        n = chunk_len(req)
        ok = n is not None and (self.allocate_fork(req, fork[0], fork[1], n) if fork is not None
                                else self.allocate(req, n, hit=hit))
        if not ok:
            if fresh:
                req.num_computed_tokens = 0
            return None
        if (hit is not None or fork is not None) and req.num_preemptions == 0:
            req.num_cached_tokens = fork[1] if fork is not None else hit.num_cached_tokens
            req.num_replayed_tokens = 0 if fork is not None else hit.num_replayed_tokens
        return n

    def _placed(self, req: Request, slot: int, hit: PrefixHit | None) -> None:
        """Ops for a request that just got its slot: reset (or set) its replay floors; with a hit restore the
        state block (exact) and hand over the token history before the resume point."""
        if hit is None:
            self._ops["floors"].append(ReplayFloor(slot=slot))
            return
        s, h = hit.start, hit.num_cached_tokens
        approx = self.prefix.mode == "approximate"
        self._ops["floors"].append(ReplayFloor(slot=slot, window_floor=s if approx else 0,
                                               write_floor=h if approx else 0))
        if hit.state_slot is not None:
            self._ops["restore"].append((hit.state_slot, slot, h))
        self._ops["history"].append(TokenHistory(slot=slot, position=s,
                                                 ids=tuple(req.token_slice(max(0, s - HISTORY_IDS), s))))
        st = self.stats
        st.hits += 1
        st.cached_tokens += h
        st.replayed_tokens += h - s
        st.host_loaded_pages += len(hit.pages.host)

    def plan_step(self, req: Request, start: int, end: int) -> None:
        """Note the pages a scheduled chunk [start, end) completes (in flight until `commit`) and, in exact mode,
        capture a state block at each page boundary in (start, end] that has none (latest first, while state
        slots can be had)."""
        if self.prefix is None:
            return
        P = self.page_size
        end = min(end, req.num_tokens)  # positions past the known tokens (drafts) are never cached
        hashes = self._hashes_upto(req, end // P)
        self._inflight.update(hashes[start // P : end // P])
        if self.prefix.mode != "exact" or not self._states.num_slots:
            return
        pending = self._pending.setdefault(req.request_id, [])
        slot = self._slots[req.request_id]
        tail = self.prefix.capture_tail
        for k in range(end // P - 1, start // P - 1, -1):  # page k ends at boundary (k + 1) * P
            b = (k + 1) * P
            if b <= start or self._states.has(hashes[k]):
                continue
            if tail is not None and (b != end or b < req.num_tokens - tail):
                continue  # a truncated prefill computed no decoder rows there
            dest = self._states.reserve()
            if dest is None:
                break
            pending.append((k, dest))
            if (k + 1) * P == end:  # the chunk stops there: copy the whole slot before the next forward
                self._snapshots_next.append((slot, dest, end))
            else:  # inside the chunk: the forward copies the rows as it computes them
                self._ops["captures"].append(Capture(slot=slot, position=(k + 1) * P, dest=dest))

    def commit(self, req: Request, upto: int | None = None) -> None:
        """After a step computed a request's chunk ending at `upto` (default: its progress): register its newly
        full pages and the state blocks captured up to there. With asynchronous scheduling the progress already
        counts the step in flight; `upto` keeps its pages out until its own output is accepted."""
        if self.prefix is None:
            return
        rid = req.request_id
        done = req.num_computed_tokens if upto is None else min(upto, req.num_computed_tokens)
        full = min(done, req.num_tokens) // self.page_size
        pages = self._pages.get(rid, [])
        hashes = self._hashes_upto(req, full)
        for k in range(self._registered.get(rid, 0), min(full, len(pages))):
            self._pool.register(pages[k], hashes[k])
        self._registered[rid] = max(self._registered.get(rid, 0), min(full, len(pages)))
        pending = self._pending.pop(rid, [])
        for k, dest in sorted(p for p in pending if p[0] < full):  # the deepest boundary ends most recently used
            self._states.commit(hashes[k], dest)
        later = [p for p in pending if p[0] >= full]  # captured by a step still in flight
        if later:
            self._pending[rid] = later

    def take_ops(self) -> CacheOps | None:
        """The cache ops of the step just scheduled (None when there are none); clears the in-flight set."""
        self._inflight.clear()
        if self.prefix is None:
            return None
        offload, load = self._pool.end_step()
        snapshots, self._snapshots_due = tuple(self._snapshots_due), self._snapshots_next
        self._snapshots_next = []
        ops = CacheOps(snapshots=snapshots, offload=tuple(offload), load=tuple(load), copy_pages=tuple(self._ops["copy"]),
                       clone_slots=tuple(self._ops["clone"]), restore=tuple(self._ops["restore"]),
                       history=tuple(self._ops["history"]), floors=tuple(self._ops["floors"]),
                       captures=tuple(self._ops["captures"]))
        for v in self._ops.values():
            v.clear()
        return None if ops.is_empty else ops

    def free(self, request: Request) -> None:
        rid = request.request_id
        self._pool.release(self._pages.pop(rid, []))
        for _, dest in self._pending.pop(rid, ()):
            self._states.cancel(dest)
        self._registered.pop(rid, None)
        self._hashes.pop(rid, None)
        self._resume_floor.pop(rid, None)
        slot = self._slots.pop(rid, None)
        if slot is not None:
            self._free_slots.append(slot)

    def reset_prefix_cache(self) -> None:
        """Drop every cached page and state block that no running request holds."""
        self._pool.reset_cache()
        self._states.reset()

    def usage(self) -> float:
        """Fraction of pages held by running requests (cached pages nobody holds count as free)."""
        return 1.0 - self._pool.num_free / self.num_pages if self.num_pages else 0.0
