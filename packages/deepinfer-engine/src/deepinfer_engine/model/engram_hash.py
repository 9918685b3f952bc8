"""Engram n-gram hashing for DeepSeek-V4.1 (docs/model.md §C.6): token map, multipliers, primes, row ids.

Everything here depends only on token ids, so it is pure numpy / Python (no torch): the engine computes the
row ids on the host and hands them to the model, which gathers rows of each layer's ``engram.embed`` table.

Layout of one engram layer's table (``engram.embed.weight [N_l, head_dim]``): for n-gram size n = 2..max_ngram
and head h = 0..n_heads-1 (in that order) a block of ``prime[l][n-2][h]`` rows; ``N_l`` is the sum of the
primes and the block offsets are the exclusive cumulative sum in (n, h) order.
"""

from __future__ import annotations

import hashlib
import os
import re
import unicodedata
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from deepinfer_engine.errors import InputError, ModelConfigError
from deepinfer_engine.model.image_ids import IMAGE_ID_SPAN

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
    """Hash-bucket primes ``[layer][n-2][head]`` for every engram layer (docs/model.md §C.6 step 3).

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
    """Odd per-shift multipliers ``M_L`` (docs/model.md §C.6 step 2): ``int64 [max_ngram_size]``.

    ``v = default_rng(10007*L).integers(0, (2**63-1)//compressed_vocab//2, size=max_ngram)``; ``M = 2v+1``.
    The bound keeps ``val * M`` (val < compressed_vocab) below 2**63, so the XOR accumulation never overflows.
    """
    if compressed_vocab_size < 1:
        raise ModelConfigError(f"engram_compressed_vocab_size: found {compressed_vocab_size}, expected >= 1")
    rng = np.random.default_rng(10007 * layer_id)
    high = (2**63 - 1) // compressed_vocab_size // 2
    v = rng.integers(0, high, size=max_ngram_size, dtype=np.int64)
    return v * 2 + 1


# ----------------------------------------------------------------------------------------------------------
# Token map: vocabulary id -> compressed id (docs/model.md §C.6 step 1)
# ----------------------------------------------------------------------------------------------------------

DEAD = -1
"""Compressed id of positions that break every n-gram (image ids, past the vocabulary): they hash as the pad
token and block older tokens from entering the n-gram. No vocabulary id is DEAD: text ids are text
(docs/fidelity.md §2)."""

TOKEN_MAP_FILENAME = "engram_token_map.npy"

_WHITESPACE_RUN = re.compile(r"[ \t\r\n]+")
# Unicode White_Space (what Rust's str::trim strips). Python's str.strip() also strips U+001C..U+001F.
_UNICODE_WHITE_SPACE = (
    "".join(
        chr(c) for c in (*range(0x9, 0xE), 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029)
    )
    + "\u202f\u205f\u3000"
)


def normalize_token_text(text: str) -> str:
    """NFKC -> NFD -> drop accents -> lowercase -> collapse [ \\t\\r\\n]+ to " " -> strip (a lone " " stays).

    "Drop accents" removes every character of Unicode general category Mark (Mn, Mc, Me), which is what the
    `tokenizers` StripAccents normaliser does; dropping only characters with a non-zero canonical combining
    class (``unicodedata.combining``) keeps Indic/Thai vowel signs and gives 99,739 instead of 99,092 classes
    for the real tokenizer. The final strip removes Unicode White_Space like Rust's ``str::trim`` (not
    U+001C..U+001F, which ``str.strip()`` would also remove); checked equal to the `tokenizers` chain on the
    whole real vocabulary in the tests.
    """
    s = unicodedata.normalize("NFD", unicodedata.normalize("NFKC", text))
    s = "".join(ch for ch in s if not unicodedata.category(ch).startswith("M"))
    s = _WHITESPACE_RUN.sub(" ", s.lower())
    if s == " ":  # a token that is exactly one (collapsed) space keeps it: "strip" must not erase it
        return s
    return s.strip(_UNICODE_WHITE_SPACE)


def _load_tokenizer(tokenizer: Any) -> Any:
    if isinstance(tokenizer, str | os.PathLike):
        import tokenizers  # lazy: only the token-map build needs the Rust tokenizer

        path = Path(tokenizer)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ModelConfigError(f"tokenizer: found no file at {str(path)!r}, expected a tokenizer.json")
        return tokenizers.Tokenizer.from_file(str(path))
    return tokenizer


def compressed_token_map(tokenizer: Any) -> np.ndarray:
    """Compressed id of every vocabulary id: ``int64 [vocab]``.

    ``tokenizer`` is a path to ``tokenizer.json`` (or its directory) or a ``tokenizers.Tokenizer``. Each id is
    decoded alone (special tokens kept, no clean-up) and keyed by:
      * its raw token string (``id_to_token``) when the decoding contains U+FFFD (a partial UTF-8 byte run);
      * otherwise ``normalize_token_text(decoded)``, or the decoded text itself when that normalises to ""
        (e.g. ``"\\x0b"`` or a lone vowel sign): [I] this fall-back is not in docs/model.md but is needed to
        reproduce the published 99,092 classes (without it: 98,875).
    All keys share one namespace (a raw token string may equal another token's normalised text).
    Compressed ids are assigned in order of first appearance over ids 0..V-1 (every id, the config's
    ``image_token_id`` included: it is an ordinary token).
    """
    tok = _load_tokenizer(tokenizer)
    vocab = int(tok.get_vocab_size(with_added_tokens=True))
    texts = tok.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    key_to_cid: dict[str, int] = {}
    out = np.empty(vocab, dtype=np.int64)
    for tid, text in enumerate(texts):
        if "\ufffd" in text:
            key = tok.id_to_token(tid)
        else:
            key = normalize_token_text(text) or text
        out[tid] = key_to_cid.setdefault(key, len(key_to_cid))
    return out


def synthetic_token_map(vocab_size: int, compressed_vocab_size: int) -> np.ndarray:
    """Tiny-config token map ``cid = id mod compressed_vocab_size`` (docs/testing.md §9.2): ``int64 [vocab]``."""
    return np.arange(vocab_size, dtype=np.int64) % compressed_vocab_size


def num_token_classes(token_map: np.ndarray) -> int:
    """Number of compressed classes of a token map (max id + 1; DEAD entries do not count)."""
    return int(token_map.max()) + 1


def save_token_map(path: str | os.PathLike, token_map: np.ndarray) -> Path:
    """Write a token map as ``.npy`` (a directory gets ``engram_token_map.npy`` inside); returns the file."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKEN_MAP_FILENAME
    np.save(p, np.asarray(token_map, dtype=np.int64), allow_pickle=False)
    return p


def load_token_map(path: str | os.PathLike, *, vocab_size: int | None = None) -> np.ndarray:
    """Read a token map written by `save_token_map` (a directory means its ``engram_token_map.npy``)."""
    p = Path(path)
    if p.is_dir():
        p = p / TOKEN_MAP_FILENAME
    arr = np.load(p, allow_pickle=False)
    if arr.ndim != 1 or arr.dtype != np.int64:
        raise ModelConfigError(
            f"engram token map {str(p)!r}: found dtype {arr.dtype} shape {arr.shape}, expected int64 [vocab]"
        )
    if vocab_size is not None and arr.shape[0] != vocab_size:
        raise ModelConfigError(
            f"engram token map {str(p)!r}: found {arr.shape[0]} entries, expected vocab_size {vocab_size}"
        )
    return arr


class TokenMapCache:
    """Owner-held memo of token maps, keyed by (resolved tokenizer path, file size, mtime).

    Building the real map takes about half a second (decode + normalise 129,280 ids); an engine or a test
    session keeps one of these instead of a module-level cache. ``get(..., cache_dir=d)`` also reads/writes
    ``d/engram_token_map.npy`` so later processes skip the build.
    """

    def __init__(self) -> None:
        self._maps: dict[tuple[str, int, int], np.ndarray] = {}

    def get(
        self,
        tokenizer_path: str | os.PathLike,
        *,
        cache_dir: str | os.PathLike | None = None,
    ) -> np.ndarray:
        path = Path(tokenizer_path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ModelConfigError(f"tokenizer: found no file at {str(path)!r}, expected a tokenizer.json")
        st = path.stat()
        key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
        hit = self._maps.get(key)
        if hit is not None:
            return hit
        arr: np.ndarray | None = None
        npy = Path(cache_dir) / TOKEN_MAP_FILENAME if cache_dir is not None else None
        if npy is not None and npy.is_file() and npy.stat().st_mtime_ns >= st.st_mtime_ns:
            arr = load_token_map(npy)
        if arr is None:
            arr = compressed_token_map(path)
            if npy is not None:
                save_token_map(npy, arr)
        arr.setflags(write=False)  # shared by every caller of this cache
        self._maps[key] = arr
        return arr


def cached_token_map(
    tokenizer_path: str | os.PathLike, cache_dir: str | os.PathLike, build: Callable[[], np.ndarray] | None = None
) -> np.ndarray:
    """`compressed_token_map` of a tokenizer.json, memoised on disk as ``cache_dir/<sha256 of the file>.npy``.
    ``build``: how to make the map on a miss (default: `compressed_token_map` of the file; the loader passes one
    that parses through its validating tokenizer loader).

    Building the map decodes and normalises every vocabulary id (~2.5 s for the real 129,280-id vocabulary on a
    slow CPU), which every model load of an Engram checkpoint would otherwise pay; the file's content hash (tens
    of ms) is the key, so any edit of the tokenizer gets its own map. A cache that cannot be read or written is
    skipped (the map is built); a file that is not a tokenizer never reaches the cache (the build raises)."""
    path = Path(tokenizer_path)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ModelConfigError(f"tokenizer: found no file at {str(path)!r}, expected a tokenizer.json")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    npy = Path(cache_dir) / f"{digest}.npy"
    try:
        arr = load_token_map(npy)
        if arr.shape[0] > 0:
            return arr
    except (OSError, ValueError, ModelConfigError):
        pass  # absent or unreadable: build it
    arr = build() if build is not None else compressed_token_map(path)
    try:
        npy.parent.mkdir(parents=True, exist_ok=True)
        tmp = npy.with_name(f".{npy.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:  # an open file: np.save would append ".npy" to a path not ending in it
            np.save(f, arr, allow_pickle=False)
        os.replace(tmp, npy)  # atomic: a concurrent reader sees the old file or the whole new one
    except OSError:
        pass  # read-only or full cache: the map is still correct, the next load builds it again
    return arr


# ----------------------------------------------------------------------------------------------------------
# Row ids (docs/model.md §C.6 step 4)
# ----------------------------------------------------------------------------------------------------------


class EngramHasher:
    """Row ids into each engram layer's ``engram.embed`` table from token ids.

    For a token at position p and engram layer L (``M = engram_multipliers(L, ...)``):
        r = 0; blocked = False
        for s in 0..max_ngram-1:
            c = cid(token[p-s]); blocked |= (p-s < 0) or c == DEAD   (DEAD: image ids, vocab <= id < vocab+5)
            r ^= (cid(pad) if blocked else c) * M[s]
            if s >= 1: row[(s-1)*n_heads + h] = r mod prime[L][s-1][h] + offset[L][(s-1)*n_heads + h]
    1-grams are not looked up. All arithmetic is int64 and cannot overflow (M bound, see engram_multipliers).
    """

    def __init__(
        self,
        *,
        layer_ids: Sequence[int],
        max_ngram_size: int,
        n_heads: int,
        vocab_size: int,
        compressed_vocab_size: int,
        pad_token_id: int,
        token_map: np.ndarray,
    ) -> None:
        token_map = np.asarray(token_map)
        if token_map.ndim != 1 or not np.issubdtype(token_map.dtype, np.integer):
            raise ModelConfigError(
                f"engram token_map: found dtype {token_map.dtype} shape {token_map.shape}, "
                "expected int64 [vocab]"
            )
        if token_map.size and (token_map.max() >= compressed_vocab_size or token_map.min() < 0):
            # a map with DEAD (-1) entries comes from a build that treated image_token_id.. as image ids
            raise ModelConfigError(
                f"engram token_map: found ids in [{token_map.min()}, {token_map.max()}], expected "
                f"0..{compressed_vocab_size - 1} (engram_compressed_vocab_size {compressed_vocab_size}) for every "
                "vocabulary id; rebuild the map with compressed_token_map (no vocabulary id is an image id)"
            )
        if not 0 <= pad_token_id < token_map.shape[0]:
            raise ModelConfigError(
                f"engram_pad_token_id: found {pad_token_id}, expected an id of the "
                f"{token_map.shape[0]}-entry token map"
            )
        self.layer_ids = tuple(int(x) for x in layer_ids)
        self.max_ngram_size = int(max_ngram_size)
        self.n_heads = int(n_heads)
        self.history_len = self.max_ngram_size - 1
        self.num_rows_per_layer = self.history_len * self.n_heads
        self.token_map = token_map.astype(np.int64, copy=False)
        self.vocab = int(self.token_map.shape[0])
        self.pad_cid = int(self.token_map[pad_token_id])
        primes = engram_primes(self.layer_ids, self.max_ngram_size, self.n_heads, vocab_size)
        # [layers, (max_ngram-1)*heads] int64, in (n, h) order
        self.primes = np.array([[p for per_n in layer for p in per_n] for layer in primes], dtype=np.int64)
        self.primes = self.primes.reshape(len(self.layer_ids), self.num_rows_per_layer)
        self.offsets = np.zeros_like(self.primes)
        self.offsets[:, 1:] = np.cumsum(self.primes, axis=1)[:, :-1]
        self.num_embeddings = tuple(int(x) for x in self.primes.sum(axis=1))
        # [layers, max_ngram] int64
        self.multipliers = np.stack(
            [engram_multipliers(L, compressed_vocab_size, self.max_ngram_size) for L in self.layer_ids]
        ).reshape(len(self.layer_ids), self.max_ngram_size)

    @classmethod
    def from_args(cls, args: Any, token_map: np.ndarray) -> EngramHasher:
        """Build from a V4.1 ``ModelArgs`` (HF config field names, `engram_*`)."""
        return cls(
            layer_ids=args.engram_layer_ids,
            max_ngram_size=args.engram_max_ngram_size,
            n_heads=args.engram_n_heads,
            vocab_size=args.engram_vocab_size,
            compressed_vocab_size=args.engram_compressed_vocab_size,
            pad_token_id=args.engram_pad_token_id,
            token_map=token_map,
        )

    def _cids(self, token_ids: np.ndarray, what: str) -> np.ndarray:
        """Compressed ids; image ids ``[vocab, vocab + IMAGE_ID_SPAN)`` (past the tokenizer) are ``DEAD``."""
        top = self.vocab + IMAGE_ID_SPAN
        if token_ids.size and (token_ids.min() < 0 or token_ids.max() >= top):
            raise InputError(
                f"{what}: found token ids in [{token_ids.min()}, {token_ids.max()}], "
                f"expected 0..{self.vocab - 1} (text) or {self.vocab}..{top - 1} (image positions)"
            )
        is_image = token_ids >= self.vocab
        return np.where(is_image, DEAD, self.token_map[np.where(is_image, 0, token_ids)])

    def hash_ids(self, token_ids: Any, history_token_ids: Any = ()) -> np.ndarray:
        """Row ids of one sequence's new tokens: ``int64 [T, num_layers, (max_ngram-1)*n_heads]``.

        ``history_token_ids``: the up-to-``max_ngram-1`` token ids right before ``token_ids`` (oldest first);
        fewer than that means the sequence starts there (missing positions block the n-gram).
        """
        toks = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        return self.hash_batch(toks, (toks.shape[0],), (history_token_ids,))

    def hash_batch(self, token_ids: Any, query_lens: Sequence[int], histories: Sequence[Any]) -> np.ndarray:
        """Batched varlen row ids: ``int64 [T, num_layers, (max_ngram-1)*n_heads]``.

        ``token_ids [T]``: new tokens of all sequences, sequence-major (as ``ForwardBatch.input_ids``);
        ``query_lens``: new tokens per sequence (sum T); ``histories[i]``: sequence i's up-to-3 previous ids.
        """
        toks = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        qlens = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        if len(histories) != qlens.shape[0]:
            raise InputError(
                f"histories: found {len(histories)} entries, expected one per sequence ({qlens.shape[0]})"
            )
        if (qlens.size and qlens.min() < 0) or int(qlens.sum()) != toks.shape[0]:
            raise InputError(
                f"query_lens: found {qlens.tolist()} (sum {int(qlens.sum())}), expected non-negative lengths "
                f"summing to the {toks.shape[0]} token ids"
            )
        hists = [np.asarray(h, dtype=np.int64).reshape(-1) for h in histories]
        for i, h in enumerate(hists):
            if h.shape[0] > self.history_len:
                raise InputError(
                    f"histories[{i}]: found {h.shape[0]} ids, expected at most {self.history_len} "
                    f"(engram_max_ngram_size - 1)"
                )
        hlens = np.array([h.shape[0] for h in hists], dtype=np.int64)
        # One flat array of [history_i, tokens_i] per sequence; new token j of sequence i sits at
        # base_i + hlen_i + j and its s-th predecessor at that index - s (valid while local index >= s).
        starts = np.concatenate([[0], np.cumsum(qlens)[:-1]]).astype(np.int64)
        pieces: list[np.ndarray] = []
        for i, h in enumerate(hists):
            pieces.append(h)
            pieces.append(toks[starts[i] : starts[i] + qlens[i]])
        ext = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
        ext_cid = self._cids(ext, "token ids / histories")
        ext_len = hlens + qlens
        ext_base = np.concatenate([[0], np.cumsum(ext_len)[:-1]]).astype(np.int64)
        seq_of_tok = np.repeat(np.arange(qlens.shape[0]), qlens)
        local = hlens[seq_of_tok] + (np.arange(toks.shape[0]) - starts[seq_of_tok])  # index inside ext_i
        glob = ext_base[seq_of_tok] + local

        T = toks.shape[0]
        out = np.empty((T, len(self.layer_ids), self.num_rows_per_layer), dtype=np.int64)
        r = np.zeros((T, len(self.layer_ids)), dtype=np.int64)
        blocked = np.zeros(T, dtype=bool)
        for s in range(self.max_ngram_size):
            exists = local >= s
            c = np.where(exists, ext_cid[np.where(exists, glob - s, 0)], DEAD)
            blocked |= c == DEAD
            val = np.where(blocked, self.pad_cid, c)
            r ^= val[:, None] * self.multipliers[None, :, s]
            if s >= 1:
                sl = slice((s - 1) * self.n_heads, s * self.n_heads)
                out[:, :, sl] = r[:, :, None] % self.primes[None, :, sl] + self.offsets[None, :, sl]
        return out
