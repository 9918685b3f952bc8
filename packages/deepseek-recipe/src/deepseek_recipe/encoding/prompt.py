"""A prompt under construction: text plus the code-point ranges of explicit special tokens."""

from __future__ import annotations

__all__ = ["Prompt"]


class Prompt:
    """Mutable builder of prompt text with explicit special-token ranges.

    Parts are kept as `(text, is_special)` pairs; ranges are computed in
    code points (Python `str` indices) when the prompt is finished.
    """

    __slots__ = ("parts",)

    def __init__(self, parts: list[tuple[str, bool]] | None = None) -> None:
        self.parts: list[tuple[str, bool]] = parts if parts is not None else []

    @classmethod
    def plain(cls, text: str) -> Prompt:
        return cls([(text, False)] if text else [])

    def copy(self) -> Prompt:
        return Prompt(list(self.parts))

    def push_plain(self, text: str) -> None:
        if text:
            self.parts.append((text, False))

    def push_special(self, text: str) -> None:
        self.parts.append((text, True))

    def extend(self, other: Prompt) -> None:
        self.parts.extend(other.parts)

    def is_empty(self) -> bool:
        return not any(text for text, _ in self.parts)

    def text(self) -> str:
        return "".join(text for text, _ in self.parts)

    def finish(self) -> tuple[str, list[tuple[int, int]]]:
        pieces: list[str] = []
        ranges: list[tuple[int, int]] = []
        pos = 0
        for text, special in self.parts:
            n = len(text)
            if special:
                ranges.append((pos, pos + n))
            pieces.append(text)
            pos += n
        return "".join(pieces), ranges
