"""Special token kinds and their spellings (the recipe's 18 token kinds)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields

from .._text import check_text, describe

__all__ = ["SpecialToken", "SpecialTokens", "IMAGE_SPECIAL_TOKEN_ID"]

# [I] docs/recipe.md §1: the V4.1 tokenizer maps the image placeholder to 129264; the
# public V4 tokenizer calls that id `<｜image2｜>`. Kept as the official constant.
IMAGE_SPECIAL_TOKEN_ID = 129264


class SpecialToken(enum.Enum):
    """A kind of special token; the value is its default spelling."""

    Bos = "<｜begin▁of▁sentence｜>"
    Eos = "<｜end▁of▁sentence｜>"
    ThinkingStart = "<think>"
    ThinkingEnd = "</think>"
    System = "<｜System｜>"
    User = "<｜User｜>"
    Assistant = "<｜Assistant｜>"
    LatestReminder = "<｜latest_reminder｜>"
    Dsml = "｜DSML｜"
    Image = "<｜image｜>"
    Ref = "<｜ref｜>"
    RefEnd = "<｜/ref｜>"
    Box = "<｜box｜>"
    BoxEnd = "<｜/box｜>"
    Point = "<｜point｜>"
    PointEnd = "<｜/point｜>"
    Polygon = "<｜polygon｜>"
    PolygonEnd = "<｜/polygon｜>"

    def default_str(self) -> str:
        """Return the default literal spelling of this token."""
        return self.value


_FIELD_OF = {
    SpecialToken.Bos: "bos",
    SpecialToken.Eos: "eos",
    SpecialToken.ThinkingStart: "thinking_start",
    SpecialToken.ThinkingEnd: "thinking_end",
    SpecialToken.System: "system",
    SpecialToken.User: "user",
    SpecialToken.Assistant: "assistant",
    SpecialToken.LatestReminder: "latest_reminder",
    SpecialToken.Dsml: "dsml",
    SpecialToken.Image: "image",
    SpecialToken.Ref: "ref",
    SpecialToken.RefEnd: "ref_end",
    SpecialToken.Box: "box",
    SpecialToken.BoxEnd: "box_end",
    SpecialToken.Point: "point",
    SpecialToken.PointEnd: "point_end",
    SpecialToken.Polygon: "polygon",
    SpecialToken.PolygonEnd: "polygon_end",
}


@dataclass(frozen=True, kw_only=True)
class SpecialTokens:
    """A mapping from each `SpecialToken` to its spelling (defaults: the default spellings)."""

    bos: str = SpecialToken.Bos.value
    eos: str = SpecialToken.Eos.value
    thinking_start: str = SpecialToken.ThinkingStart.value
    thinking_end: str = SpecialToken.ThinkingEnd.value
    system: str = SpecialToken.System.value
    user: str = SpecialToken.User.value
    assistant: str = SpecialToken.Assistant.value
    latest_reminder: str = SpecialToken.LatestReminder.value
    dsml: str = SpecialToken.Dsml.value
    image: str = SpecialToken.Image.value
    ref: str = SpecialToken.Ref.value
    ref_end: str = SpecialToken.RefEnd.value
    box: str = SpecialToken.Box.value
    box_end: str = SpecialToken.BoxEnd.value
    point: str = SpecialToken.Point.value
    point_end: str = SpecialToken.PointEnd.value
    polygon: str = SpecialToken.Polygon.value
    polygon_end: str = SpecialToken.PolygonEnd.value

    def __init__(self, **spellings: str | None) -> None:
        # Mirrors the official keyword API where `None` means "default spelling".
        known = {f.name for f in fields(type(self))}
        for name, value in spellings.items():
            if name not in known:
                raise TypeError(
                    f"SpecialTokens got an unknown token {describe(name)}; expected one of {sorted(known)}"
                )
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"SpecialTokens.{name} must be a non-empty string, got {describe(value)}")
            if value is not None:
                check_text(value, f"SpecialTokens.{name}")
        for f in fields(type(self)):
            value = spellings.get(f.name)
            object.__setattr__(self, f.name, f.default if value is None else value)

    def token(self, token: SpecialToken) -> str:
        """Return the spelling of `token` in this mapping."""
        return getattr(self, _FIELD_OF[token])


DEFAULT_SPECIAL_TOKENS = SpecialTokens()
