"""Incremental detokenization that never emits broken UTF-8.

Ids in the tokenizer's added vocabulary are decoded alone and flagged
special; runs of ordinary ids are decoded together and held back while the
decoded text ends with U+FFFD (an incomplete UTF-8 sequence). A special token
forces out whatever ordinary ids were pending (then a genuinely invalid byte
sequence shows as U+FFFD, as the reference does).
"""

from __future__ import annotations

__all__ = ["StreamDecoder", "DecodedText"]

_REPLACEMENT = "\ufffd"


class DecodedText:
    __slots__ = ("content", "token_count", "is_special_token")

    def __init__(self, content: str, token_count: int, is_special_token: bool) -> None:
        self.content = content
        self.token_count = token_count
        self.is_special_token = is_special_token


class StreamDecoder:
    """Buffers ids and releases decoded pieces at safe boundaries."""

    __slots__ = ("tokenizer", "_ids", "_added", "_bytes")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = []
        self._added = tokenizer._added_ids
        self._bytes = tokenizer._id_bytes

    def decode_incrementally(self, token_ids) -> list[DecodedText]:
        pieces: list[DecodedText] = []
        added = self._added
        for tid in token_ids:
            if type(tid) is not int:
                try:
                    tid = int(tid)
                except (TypeError, ValueError):
                    raise RuntimeError(f"failed to decode token IDs: invalid token id {tid!r}") from None
            if tid < 0 or tid >= 2**32:
                raise RuntimeError(f"failed to decode token IDs: token id {tid} is out of range")
            if tid in added:
                self._flush(True, False, pieces)
                self._ids.append(tid)
                self._flush(True, True, pieces)
            else:
                self._ids.append(tid)
        self._flush(False, False, pieces)
        return pieces

    def _flush(self, force: bool, special: bool, pieces: list[DecodedText]) -> None:
        if not self._ids:
            return
        get = self._bytes.get
        content = b"".join(get(i, b"") for i in self._ids).decode("utf-8", errors="replace")
        if not content or (not force and content.endswith(_REPLACEMENT)):
            return
        pieces.append(DecodedText(content, len(self._ids), special))
        self._ids = []
