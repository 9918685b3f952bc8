"""A small deterministic stand-in model honouring the ForwardBatch / ModelCache contract (contracts.md §3):
it keeps one vector per position in paged storage (block table addressing) and a per-slot ring of the last
RING positions, and its logits depend on the whole prefix through both. A dense cache-free recompute is the same
forward on a fresh cache. Bugs in paging, slots, chunking or preemption change its outputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from deepinfer_engine.config import EngineConfig
from deepinfer_engine.core.kv_cache import plan_cache
from deepinfer_engine.core.kv_cache_spec import CacheFamily
from deepinfer_engine.engine import EngineCore
from deepinfer_engine.llm_engine import LLMEngine
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.worker.async_runner import AsyncModelRunner
from deepinfer_engine.worker.model_runner import ModelRunner

RING = 3
DIM = 8


class FakeCache:
    def __init__(self, num_slots: int, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.pages = torch.full((num_pages, page_size, DIM), float("nan"))
        self.ring = torch.full((num_slots, RING, DIM), float("nan"))


class FakeModel:
    def __init__(self, vocab: int = 40, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.vocab = vocab
        self.emb = torch.randn(vocab, DIM, generator=g, dtype=torch.float64)
        self.pos = torch.randn(64, DIM, generator=g, dtype=torch.float64) * 0.3
        self.w_out = torch.randn(DIM, vocab, generator=g, dtype=torch.float64)

    def __call__(self, batch: ForwardBatch, cache: FakeCache) -> torch.Tensor:
        ps = cache.page_size
        rows = []
        t = 0
        for i, n in enumerate(batch.query_lens):
            slot = batch.slots[i]
            table = batch.block_tables[i]
            for k in range(n):
                p = int(batch.positions[t + k])
                v = self.emb[int(batch.input_ids[t + k])] + self.pos[p % 64]
                page = int(table[p // ps])
                assert page >= 0, "position beyond the block table"
                cache.pages[page, p % ps] = v.float()
                cache.ring[slot, p % RING] = v.float()
                prefix = torch.stack([cache.pages[int(table[q // ps]), q % ps] for q in range(p + 1)]).double()
                decay = 0.8 ** torch.arange(p, -1, -1, dtype=torch.float64)
                h = (prefix * decay[:, None]).sum(0)
                recent = [cache.ring[slot, q % RING].double() for q in range(max(0, p - RING + 1), p + 1)]
                h = h + torch.stack(recent).sum(0) * torch.linspace(-1, 1, DIM, dtype=torch.float64)
                rows.append(torch.tanh(h) @ self.w_out)
            t += n
        logits = torch.stack(rows)
        return logits[batch.logits_indices].float()

    def dense_logits(self, ids: list[int]) -> torch.Tensor:
        """Cache-free reference: a fresh cache, the whole sequence in one forward; [len(ids), V] float32."""
        cache = FakeCache(1, -(-len(ids) // 4) + 1, 4)
        bt = torch.arange(cache.pages.shape[0], dtype=torch.int32)[None]
        return self(ForwardBatch.single(torch.tensor(ids), block_table=bt), cache)


class FakeTokenizer:
    """id -> one character (a..z, then A..Z); id 1 is EOS and decodes to '' when special tokens are skipped."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        return "".join("" if (t == 1 and skip_special_tokens) else chars[t % len(chars)] for t in ids)


def make_engine(model: FakeModel, *, num_pages: int = 200, page_size: int = 4, max_num_seqs: int = 8,
                max_num_batched_tokens: int = 64, max_model_len: int = 60, seed: int = 0,
                tokenizer=None, eos=(1,), async_scheduling: bool = False) -> LLMEngine:
    config = EngineConfig.from_options(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                       max_model_len=max_model_len, seed=seed, page_size=page_size,
                                       num_kv_pages=num_pages, async_scheduling=async_scheduling)
    families = [CacheFamily(name="fake_paged", kind="paged", num_layers=1, bytes_per_token=DIM * 4),
                CacheFamily(name="fake_ring", kind="slot", num_layers=1, bytes_per_slot=RING * DIM * 4)]
    plan = plan_cache(families, page_size=page_size, memory_bytes=None, max_num_seqs=max_num_seqs,
                      max_model_len=max_model_len, num_pages=num_pages)
    cache = FakeCache(plan.num_slots, plan.num_pages, page_size)
    runner = (AsyncModelRunner if async_scheduling else ModelRunner)(model, cache, device="cpu", eos_token_ids=eos)
    vocab = getattr(model, "vocab", None)
    core = EngineCore(config=config, runner=runner, plan=plan, max_model_len=max_model_len, eos_token_ids=eos,
                      args=SimpleNamespace(vocab_size=vocab) if vocab is not None else None)
    return LLMEngine(core, tokenizer=tokenizer, bos_token_id=None)


@pytest.fixture
def fake_model() -> FakeModel:
    return FakeModel()


@pytest.fixture
def make_fake_engine():
    return make_engine


@pytest.fixture
def fake_tokenizer() -> FakeTokenizer:
    return FakeTokenizer()
