"""Device Engram row ids (engram_hash_device.py) against the numpy reference `EngramHasher.hash_batch`: bit-exact
int64 on random ids with image ids, short histories and varlen batches, for the tiny and the real V4.1 config."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_engine.errors import InputError
from deepinfer_engine.model.engram_hash import EngramHasher, synthetic_token_map
from deepinfer_engine.model.engram_hash_device import DeviceEngramHasher
from deepinfer_engine.model.image_ids import IMAGE_ID_SPAN

TINY = dict(layer_ids=[1, 3], max_ngram_size=4, n_heads=2, vocab_size=64, compressed_vocab_size=16, pad_token_id=2)
TINY_VOCAB = 512


def _predecessors(toks: np.ndarray, qlens: list[int], hists: list[np.ndarray], back: int) -> torch.Tensor:
    """[T, back]: the id at position p-s of each token's sequence (its history, then its own tokens), -1 before
    the sequence's first known id -- what token_ring.ring_step hands the device hasher."""
    out, start = [], 0
    for n, h in zip(qlens, hists):
        ext = np.concatenate([np.asarray(h, dtype=np.int64), toks[start : start + n]])
        for j in range(n):
            loc = len(h) + j
            out.append([ext[loc - s] if loc - s >= 0 else -1 for s in range(1, back + 1)])
        start += n
    return torch.tensor(out, dtype=torch.int64).reshape(-1, back)


def _random_batch(rng, vocab: int, qlens: list[int], back: int, image_rate: float = 0.05):
    T = sum(qlens)
    toks = rng.integers(0, vocab, size=T)
    img = rng.random(T) < image_rate
    toks[img] = vocab + rng.integers(0, IMAGE_ID_SPAN, size=int(img.sum()))
    hists = []
    for _ in qlens:
        h = rng.integers(0, vocab, size=int(rng.integers(0, back + 1)))
        if h.size and rng.random() < 0.3:
            h[int(rng.integers(0, h.size))] = vocab + 1  # an image id inside the history
        hists.append(h)
    return toks, hists


def _check(hasher: EngramHasher, dev: DeviceEngramHasher, toks, qlens, hists) -> None:
    ref = hasher.hash_batch(toks, qlens, hists)
    prev = _predecessors(toks, qlens, hists, hasher.history_len)
    got = dev.rows(torch.from_numpy(toks.astype(np.int64)), prev)
    assert got.dtype == torch.int64 and tuple(got.shape) == ref.shape
    np.testing.assert_array_equal(got.numpy(), ref)


def test_tiny_config_random_varlen_batches_equal_reference():
    hasher = EngramHasher(**TINY, token_map=synthetic_token_map(TINY_VOCAB, 16))
    dev = DeviceEngramHasher(hasher, "cpu")
    rng = np.random.default_rng(0)
    for trial in range(20):
        qlens = [int(x) for x in rng.integers(1, 9, size=int(rng.integers(1, 6)))]
        toks, hists = _random_batch(rng, TINY_VOCAB, qlens, hasher.history_len, image_rate=0.1 * (trial % 3))
        _check(hasher, dev, toks, qlens, hists)


def test_short_histories_and_pad_rules_equal_reference():
    # every history length 0..3 with one new token (decode rows), and a pad id inside the n-gram (an ordinary
    # token: only missing / image positions block)
    hasher = EngramHasher(**TINY, token_map=synthetic_token_map(TINY_VOCAB, 16))
    dev = DeviceEngramHasher(hasher, "cpu")
    hists = [np.array([], np.int64), np.array([7]), np.array([2, 9]), np.array([5, 2, 9]), np.array([TINY_VOCAB, 3, 4])]
    toks = np.array([11, 12, 2, TINY_VOCAB + 4, 13])
    _check(hasher, dev, toks, [1] * 5, hists)


def test_real_v41_config_equals_reference():
    # the released config's layers, primes (16,000,000 base) and multipliers (compressed vocab 99,092): values near
    # 2**62 before the reduction, so an overflow or a different remainder would show
    from deepinfer_engine.model.args import ModelArgs
    from deepinfer_engine.model.presets import v41_flash_config

    args = ModelArgs.from_config_dict(v41_flash_config())
    tmap = synthetic_token_map(args.vocab_size, args.engram_compressed_vocab_size)
    hasher = EngramHasher.from_args(args, tmap)
    dev = DeviceEngramHasher(hasher, "cpu")
    rng = np.random.default_rng(1)
    qlens = [1] * 16 + [37, 5, 64]
    toks, hists = _random_batch(rng, args.vocab_size, qlens, hasher.history_len)
    toks[:4] = args.vocab_size - 1 - np.arange(4)  # the largest compressed ids
    _check(hasher, dev, toks, qlens, hists)
    rows = dev.rows(torch.from_numpy(toks), _predecessors(toks, qlens, hists, 3))
    assert rows.shape == (sum(qlens), 2, 24) and int(rows.max()) < max(hasher.num_embeddings)


def test_empty_step_and_bad_shapes():
    hasher = EngramHasher(**TINY, token_map=synthetic_token_map(TINY_VOCAB, 16))
    dev = DeviceEngramHasher(hasher, "cpu")
    assert dev.rows(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 3, dtype=torch.int64)).shape == (0, 2, 6)
    with pytest.raises(InputError, match=r"\[T, 3\]"):
        dev.rows(torch.zeros(2, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64))


@pytest.mark.gpu
def test_cuda_equals_reference_inside_a_graph():
    hasher = EngramHasher(**TINY, token_map=synthetic_token_map(TINY_VOCAB, 16))
    dev = DeviceEngramHasher(hasher, "cuda")
    rng = np.random.default_rng(2)
    toks, hists = _random_batch(rng, TINY_VOCAB, [1] * 8, 3, image_rate=0.2)
    ids = torch.from_numpy(toks).cuda()
    prev = _predecessors(toks, [1] * 8, hists, 3).cuda()
    dev.rows(ids, prev)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = dev.rows(ids, prev)
    toks2, hists2 = _random_batch(rng, TINY_VOCAB, [1] * 8, 3, image_rate=0.2)
    ids.copy_(torch.from_numpy(toks2))
    prev.copy_(_predecessors(toks2, [1] * 8, hists2, 3))
    graph.replay()
    np.testing.assert_array_equal(out.cpu().numpy(), hasher.hash_batch(toks2, [1] * 8, hists2))


def test_model_rows_equal_reference_through_steps(make_tiny_v41_model):
    """The model's wiring (Transformer._engram_rows: batch ids / positions, sequence tensors, the cache's device
    token ring) over a prefill chunk, a mixed step and a decode step equals hash_batch over the true histories."""
    from deepinfer_engine.model.cache import ModelCache
    from deepinfer_engine.model.forward_batch import ForwardBatch, ForwardContext

    model = make_tiny_v41_model(0)
    a = model.args
    cache, tables = ModelCache.allocate_dense(a, [64, 64, 64], dtype=torch.float32)
    rng = np.random.default_rng(4)
    seqs = {s: [int(x) for x in rng.integers(0, a.vocab_size, size=40)] for s in range(3)}
    seqs[1][5:8] = [a.vocab_size, a.vocab_size + 2, a.vocab_size + 4]  # image positions
    done = {0: 0, 1: 0, 2: 0}
    for step in ([(0, 13), (1, 9)], [(2, 4), (0, 1), (1, 6)], [(1, 1), (2, 1), (0, 1)]):
        slots = [s for s, _ in step]
        ids = [t for s, n in step for t in seqs[s][done[s] : done[s] + n]]
        pos = [p for s, n in step for p in range(done[s], done[s] + n)]
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(pos), query_lens=tuple(n for _, n in step),
            slots=tuple(slots), block_tables=tables[slots], logits_indices=torch.tensor([len(ids) - 1]),
        )  # fmt: skip
        got = model._engram_rows(ForwardContext.build(batch, cache))
        hists = [seqs[s][max(0, done[s] - 3) : done[s]] for s in slots]
        want = model.engram_hasher.hash_batch(np.asarray(ids), batch.query_lens, hists)
        np.testing.assert_array_equal(got.numpy(), want)
        for s, n in step:
            done[s] += n
