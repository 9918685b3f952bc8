"""Engram n-gram hashing for DeepSeek-V4.1 (architecture.md §C.6): token map, multipliers, primes, row ids.

Everything here depends only on token ids, so it is pure numpy / Python (no torch): the engine computes the
row ids on the host and hands them to the model, which gathers rows of each layer's ``engram.embed`` table.

Layout of one engram layer's table (``engram.embed.weight [N_l, head_dim]``): for n-gram size n = 2..max_ngram
and head h = 0..n_heads-1 (in that order) a block of ``prime[l][n-2][h]`` rows; ``N_l`` is the sum of the
primes and the block offsets are the exclusive cumulative sum in (n, h) order.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from deepinfer_engine.errors import InputError, ModelConfigError

# Miller-Rabin witnesses that make the test deterministic for every n < 3.3e24 (covers int64).
_MR_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def is_prime(n: int) -> bool:
    """Deterministic primality test for non-negative integers below 3.3e24 (Miller-Rabin, fixed witnesses)."""
    if n < 2:
        return False
    for p in _MR_WITNESSES:
        if n % p == 0:
            return n == p
    d, s = n - 1, 0
    while d % 2 == 0:
        d //= 2
        s += 1
    for a in _MR_WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(s - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def engram_primes(
    layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size: int
) -> list[list[list[int]]]:
    """Hash-bucket primes ``[layer][n-2][head]`` for every engram layer (§C.6 step 3).

    For each engram layer in the given order, for n = 2..max_ngram_size, for head h: the smallest prime that is
    >= ``vocab_size`` (i.e. "the next prime above vocab_size-1") and was not handed out before. The "seen"
    set is global over all layers, so the second layer continues where the first one stopped.
    ``vocab_size`` is the config's ``engram_vocab_size`` (a bucket base, not the tokenizer vocabulary).
    """
    if max_ngram_size < 2:
        raise ModelConfigError(f"engram_max_ngram_size: found {max_ngram_size}, expected >= 2")
    if n_heads < 1:
        raise ModelConfigError(f"engram_n_heads: found {n_heads}, expected >= 1")
    if vocab_size < 2:
        raise ModelConfigError(f"engram_vocab_size: found {vocab_size}, expected >= 2")
    candidate = vocab_size - 1  # the last value handed out (or the start): search strictly above it
    out: list[list[list[int]]] = []
    for _layer in layer_ids:
        per_layer: list[list[int]] = []
        for _n in range(2, max_ngram_size + 1):
            per_n: list[int] = []
            for _h in range(n_heads):
                candidate += 1
                while not is_prime(candidate):
                    candidate += 1
                per_n.append(candidate)
            per_layer.append(per_n)
        out.append(per_layer)
    return out


def engram_num_embeddings(
    layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, vocab_size: int
) -> list[int]:
    """Rows of each engram layer's table (= sum of that layer's primes); must equal `engram_num_embeddings`."""
    return [
        sum(sum(per_n) for per_n in per_layer)
        for per_layer in engram_primes(layer_ids, max_ngram_size, n_heads, vocab_size)
    ]


def engram_multipliers(layer_id: int, compressed_vocab_size: int, max_ngram_size: int) -> np.ndarray:
    """Odd per-shift multipliers ``M_L`` (§C.6 step 2): ``int64 [max_ngram_size]``.

    ``v = default_rng(10007*L).integers(0, (2**63-1)//compressed_vocab//2, size=max_ngram)``; ``M = 2v+1``.
    The bound keeps ``val * M`` (val < compressed_vocab) below 2**63, so the XOR accumulation never overflows.
    """
    if compressed_vocab_size < 1:
        raise ModelConfigError(
            f"engram_compressed_vocab_size: found {compressed_vocab_size}, expected >= 1"
        )
    rng = np.random.default_rng(10007 * layer_id)
    high = (2**63 - 1) // compressed_vocab_size // 2
    v = rng.integers(0, high, size=max_ngram_size, dtype=np.int64)
    return v * 2 + 1
