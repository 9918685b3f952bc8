"""The device token ring (token_ring.ring_step) through a cache's life: every step's predecessors equal the ids of the
sequence's true history, and the row ids hashed from them equal `EngramHasher.hash_batch` given that history.

Steps mix chunked prefill (chunks longer than the ring), decode, speculative tails rolled back by up to
slack + 1 tokens, a fork (`clone_slot`), a resume from host-known ids (`set_token_history`, a prefix-cache hit
or a preempted request) and a slot reused by a new sequence, all in varlen batches."""

from __future__ import annotations

import numpy as np
import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.engram_hash import EngramHasher, synthetic_token_map
from deepinfer_engine.model.engram_hash_device import DeviceEngramHasher
from deepinfer_engine.model.presets import tiny_v41_config
from deepinfer_engine.model.token_ring import ring_step

SLACK = 2


class _Sim:
    """Slot -> the true token list of its sequence; runs varlen steps through the cache's device ring."""

    def __init__(self) -> None:
        self.args = ModelArgs.from_config_dict(tiny_v41_config())
        self.cache = ModelCache.allocate(self.args, num_slots=4, num_pages=4, page_size=8, dtype=torch.float32,
                                         slack=SLACK)  # fmt: skip
        tmap = synthetic_token_map(self.args.vocab_size, 97)
        self.hasher = EngramHasher(layer_ids=self.args.engram_layer_ids, max_ngram_size=4, n_heads=2,
                                   vocab_size=64, compressed_vocab_size=97, pad_token_id=2, token_map=tmap)  # fmt: skip
        self.dev = DeviceEngramHasher(self.hasher, "cpu")
        self.seqs: dict[int, list[int]] = {}
        self.rng = np.random.default_rng(0)
        self.steps = 0

    def new_ids(self, n: int) -> list[int]:
        ids = self.rng.integers(0, self.args.vocab_size, size=n)
        ids[self.rng.random(n) < 0.1] = self.args.vocab_size + 1  # image positions
        return [int(x) for x in ids]

    def step(self, parts: list[tuple[int, int, list[int]]]) -> None:
        """parts: (slot, ctx, new ids); the sequence's ids at positions >= ctx are replaced by the new ones."""
        ids, pos, seq, hists = [], [], [], []
        for i, (slot, c, new) in enumerate(parts):
            known = self.seqs.setdefault(slot, [])
            hists.append(known[max(0, c - 3) : c])
            self.seqs[slot] = known[:c] + new
            ids += new
            pos += range(c, c + len(new))
            seq += [i] * len(new)
        t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
        ctx_t, qlen_t, slot_t = t([c for _, c, _ in parts]), t([len(n) for *_, n in parts]), t([s for s, *_ in parts])
        ring = self.cache.token_ring
        prev = ring_step(ring, t(ids), t(pos), t(seq), ctx_t, qlen_t, slot_t, back=3, dump_slot=self.cache.scratch_slot)
        want = [[self.seqs[parts[i][0]][p - s] if p - s >= 0 else -1 for s in (1, 2, 3)] for p, i in zip(pos, seq)]
        assert prev.tolist() == want, self.steps
        ref = self.hasher.hash_batch(np.asarray(ids), [len(n) for *_, n in parts], hists)
        np.testing.assert_array_equal(self.dev.rows(t(ids), prev).numpy(), ref)
        self.steps += 1


def test_ring_history_through_prefill_decode_rollback_fork_resume():
    sim = _Sim()
    R = sim.cache.token_ring.shape[1]
    assert R == 3 + SLACK + 1  # a rollback of slack + 1 tokens keeps the 3 ids before the resume point
    sim.step([(0, 0, sim.new_ids(2 * R + 1)), (1, 0, sim.new_ids(3))])  # a chunk longer than the ring
    sim.step([(1, 3, sim.new_ids(7)), (0, 2 * R + 1, sim.new_ids(1))])  # next chunk / decode, any order
    for _ in range(3):  # speculative verify steps: 4 tokens, then a rollback of up to slack + 1 = 3
        n0, n1 = len(sim.seqs[0]), len(sim.seqs[1])
        sim.step([(0, n0, sim.new_ids(4)), (1, n1, sim.new_ids(2))])
        sim.step([(0, n0 + 1, sim.new_ids(1)), (1, n1 + 2, sim.new_ids(1))])
    # fork: slot 2 starts from slot 0's state one token behind its end
    n0 = len(sim.seqs[0])
    sim.cache.clone_slot(0, 2, n0 - 1)
    sim.seqs[2] = list(sim.seqs[0][: n0 - 1])
    sim.step([(2, n0 - 1, sim.new_ids(1)), (0, n0, sim.new_ids(1))])
    # resume from host-known ids in a reused slot (prefix-cache hit / preempted request): slot 1 gets a new
    # sequence whose first 20 ids are known, only its last R ids handed over
    sim.cache.reset_slot(1)
    known = sim.new_ids(20)
    sim.cache.set_token_history(1, 20, known[-R:])
    sim.seqs[1] = known
    sim.step([(1, 20, sim.new_ids(2)), (2, n0, sim.new_ids(1))])
    # a new sequence at position 0 in a slot with stale ids: nothing from the old sequence leaks in
    sim.seqs.pop(0)
    sim.step([(0, 0, sim.new_ids(2)), (1, 22, sim.new_ids(1))])
    sim.step([(0, 2, sim.new_ids(1))])
    assert sim.steps == 12
