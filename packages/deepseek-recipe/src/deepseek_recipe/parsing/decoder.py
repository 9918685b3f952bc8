"""Incremental detokenization that never emits broken UTF-8.

Ids in the tokenizer's added vocabulary are decoded alone and flagged
special; runs of ordinary ids are decoded together and held back while the
decoded text ends with U+FFFD (an incomplete UTF-8 sequence). A special token
forces out whatever ordinary ids were pending (then a genuinely invalid byte
sequence shows as U+FFFD, as the reference does). Ids still buffered at the
end of the stream are dropped.
"""

from __future__ import annotations

from .._text import describe
from ..options import f32

__all__ = ["StreamDecoder", "DecodedText", "f32_json"]

_REPLACEMENT = "\ufffd"


def f32_json(value: float) -> float | None:
    """The shortest decimal that denotes the same f32 (how the reference serializes f32 values).

    NaN and infinities become None: serde_json writes them as `null` (a bare `NaN` is not JSON).
    """
    v = f32(float(value))
    if v != v or v in (float("inf"), float("-inf")):
        return None
    for digits in range(1, 10):
        candidate = float(f"{v:.{digits}g}")
        if f32(candidate) == v:
            return candidate
    return v


class DecodedText:
    __slots__ = ("content", "token_count", "is_special_token", "logprobs")

    def __init__(self, content: str, token_count: int, is_special_token: bool, logprobs=None) -> None:
        self.content = content
        self.token_count = token_count
        self.is_special_token = is_special_token
        self.logprobs = logprobs


class StreamDecoder:
    """Buffers ids and releases decoded pieces at safe boundaries."""

    __slots__ = ("tokenizer", "_ids", "_added", "_bytes", "_lps")

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = []
        self._added = tokenizer._added_ids
        self._bytes = tokenizer._id_bytes
        self._lps: list | None = []  # None once any buffered id came without a log probability

    def decode_incrementally(self, token_ids, logprobs=None) -> list[DecodedText]:
        if logprobs is not None and len(logprobs) != len(token_ids):
            raise RuntimeError(
                f"invalid log probabilities: {len(logprobs)} log probabilities for {len(token_ids)} token IDs"
            )
        pieces: list[DecodedText] = []
        added = self._added
        for k, tid in enumerate(token_ids):
            if type(tid) is not int:
                try:
                    tid = int(tid)
                except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
                    raise RuntimeError(f"failed to decode token IDs: invalid token id {describe(tid)}") from None
            if tid < 0 or tid >= 2**32:
                raise RuntimeError(f"failed to decode token IDs: token id {tid} is out of range")
            lp = None if logprobs is None else logprobs[k]
            if tid in added:
                self._flush(True, False, pieces)
                self._push(tid, lp)
                self._flush(True, True, pieces)
            else:
                self._push(tid, lp)
        self._flush(False, False, pieces)
        return pieces

    def _push(self, tid: int, lp) -> None:
        self._ids.append(tid)
        if self._lps is not None and lp is not None:
            self._lps.append(lp)
        else:
            self._lps = None

    def _flush(self, force: bool, special: bool, pieces: list[DecodedText]) -> None:
        if not self._ids:
            return
        get = self._bytes.get
        content = b"".join(get(i, b"") for i in self._ids).decode("utf-8", errors="replace")
        if not content or (not force and content.endswith(_REPLACEMENT)):
            return
        lps, self._lps = self._lps, []
        logprobs = self._create_logprobs(self._ids, lps) if lps else None
        pieces.append(DecodedText(content, len(self._ids), special, logprobs))
        self._ids = []

    def _token(self, tid: int) -> tuple[list[int], str]:
        raw = self._bytes.get(tid)
        if raw is None:
            raw = b""
        elif tid in self._added:
            raw = self._added[tid].encode("utf-8")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "".join(f"\\x{b:02x}" for b in raw)
        return list(raw), text

    def _create_logprobs(self, ids: list[int], lps: list) -> list[dict]:
        out = []
        for tid, (logprob, top) in zip(ids, lps):
            bts, token = self._token(tid)
            tops = []
            for top_id, top_lp in top:
                tb, tt = self._token(int(top_id))
                tops.append({"token": tt, "logprob": f32_json(top_lp), "bytes": tb})
            out.append({"token": token, "logprob": f32_json(logprob), "bytes": bts, "top_logprobs": tops})
        return out
