"""Engram hashing (architecture.md §C.6): published primes, multipliers, token-map class count, row ids."""

from __future__ import annotations

import numpy as np
import pytest

from deepinfer_engine.errors import ModelConfigError
from deepinfer_engine.model.engram_hash import (
    engram_multipliers,
    engram_num_embeddings,
    engram_primes,
    is_prime,
)


def test_is_prime_small_numbers_match_trial_division():
    def trial(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(300) if is_prime(n)] == [n for n in range(300) if trial(n)]
    assert is_prime(16000057) and not is_prime(16000059 * 16000057)


def test_primes_tiny_config_published_values():
    # architecture.md §9.2: engram_vocab_size 64, 2 heads, max n-gram 4, layers [1, 3].
    primes = engram_primes([1, 3], 4, 2, 64)
    assert primes == [[[67, 71], [73, 79], [83, 89]], [[97, 101], [103, 107], [109, 113]]]
    assert engram_num_embeddings([1, 3], 4, 2, 64) == [462, 630]


def test_primes_real_config_published_values():
    # architecture.md §1.3 / §C.6: engram_vocab_size 16,000,000, 8 heads, max n-gram 4, layers [1, 14].
    primes = engram_primes([1, 14], 4, 8, 16_000_000)
    assert primes[0][0][:3] == [16000057, 16000079, 16000081]
    assert primes[1][0][0] == 16000477
    flat = [p for layer in primes for per_n in layer for p in per_n]
    assert len(set(flat)) == len(flat) == 48
    assert flat == sorted(flat)
    assert engram_num_embeddings([1, 14], 4, 8, 16_000_000) == [384006168, 384016682]


def test_primes_reject_bad_sizes():
    with pytest.raises(ModelConfigError, match="engram_max_ngram_size"):
        engram_primes([1], 1, 2, 64)
    with pytest.raises(ModelConfigError, match="engram_n_heads"):
        engram_primes([1], 4, 0, 64)


def test_multipliers_published_values():
    # architecture.md §C.6 step 2 (compressed vocab 99,092).
    m1 = engram_multipliers(1, 99092, 4)
    m14 = engram_multipliers(14, 99092, 4)
    assert m1.dtype == np.int64 and m1.shape == (4,)
    assert m1.tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert m14.tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    # odd, and small enough that val * M stays inside int64 for every compressed id
    assert all(int(m) % 2 == 1 and int(m) * 99091 < 2**63 for m in list(m1) + list(m14))
