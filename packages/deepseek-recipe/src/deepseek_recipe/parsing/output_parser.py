"""Byte-level output parser: generated text → `(action, byte_len)` segments.

The parser is a small state machine over *bytes*. Each stage watches a list of
markers ("branches", matched incrementally with KMP so a marker split across
chunks is still found). Bytes that cannot be the start of a marker get the
stage's "unmatched" action; bytes that might still become a marker are held
back (buffered) until resolved. When several branches complete on the same
byte, the first registered one wins. A marker unit is `(byte, is_special)`:
for text chunks every unit matches by byte; for token chunks a special unit
matches only bytes decoded from a special token and a plain unit only bytes
from ordinary tokens (so a `</think>` spelled with ordinary tokens is content).
"""

from __future__ import annotations

from ..encoding.special_tokens import DEFAULT_SPECIAL_TOKENS

__all__ = ["OutputParser", "TEXT", "PLAIN_TOKENS", "SPECIAL_TOKEN"]

# Chunk kinds.
TEXT, PLAIN_TOKENS, SPECIAL_TOKEN = 0, 1, 2

# Actions (hashable tuples so that "same action" comparisons include their data).
CONTENT = ("content",)
TO_SPACE = ("to_space",)
SKIP = ("skip",)
SKIP_EXTRA_THINK_END = ("skip_invalid", "extra_end_of_thinking")
SKIP_AFTER_FINISHED = ("skip_invalid", "content_after_finished")
STOP_SEQUENCE = ("stop_sequence",)
TOOL_CALL_BEGIN = ("tool_call_begin",)
TOOL_NAME = ("tool_name",)
TOOL_NAME_END = ("tool_name_end",)
REASONING = ("reasoning",)
LABEL_OBJECT_OPEN = ("label_args", "{")
LABEL_ARG_SEP = ("label_args", ", ")
LABEL_KV_SEP = ("label_args", ": ")
LABEL_STRING_OPEN = ("label_args", '"', "open")
LABEL_STRING_CLOSE = ("label_args", '"', "close")
ARGS_TEXT_RAW = ("args_text", False)
ARGS_TEXT_STRING = ("args_text", True)
ARGS_END_EMPTY = ("args_end", "{}")
ARGS_END = ("args_end", "}")


def label(text: str) -> tuple:
    return ("label", text)


# Stages: (name, flag)
S_CONTENT = "content"
S_JSON = "json"
S_AFTER_JSON = "after_json"
S_TOOL_CALLS = "tool_calls"
S_TOOL_NAME = "tool_name"
S_ARGS = "args"
S_ARG_NAME = "arg_name"
S_ARG_STRING_ATTR = "arg_string_attr"
S_ARG_VALUE = "arg_value"
S_REASONING = "reasoning"
S_FINISHED = "finished"

# Matcher kinds.
_MARKER, _NEWLINES_AND_MARKER, _LEADING_NEWLINE = 0, 1, 2


def _pattern(segments) -> tuple:
    units = []
    for text, special in segments:
        units.extend((b, special) for b in text.encode("utf-8"))
    return tuple(units)


def _plain(text: str) -> tuple:
    return _pattern([(text, False)])


def _kmp_table(pattern: tuple) -> tuple:
    table = [0] * len(pattern)
    length, i = 0, 1
    while i < len(pattern):
        if pattern[i] == pattern[length]:
            length += 1
            table[i] = length
            i += 1
        elif length:
            length = table[length - 1]
        else:
            table[i] = 0
            i += 1
    return tuple(table)


class _Branch:
    """One marker being matched: pattern, KMP table, progress, and what a match does."""

    __slots__ = (
        "kind",
        "pattern",
        "table",
        "matched",
        "newlines",
        "first",
        "next_stage",
        "action",
        "first_bytes",
    )

    def __init__(self, kind: int, pattern: tuple, next_stage: tuple, action: tuple) -> None:
        self.kind = kind
        self.pattern = pattern
        self.table = _kmp_table(pattern) if pattern else ()
        self.matched = 0
        self.newlines = 0
        self.first = True  # leading-newline matcher: still at the first byte
        self.next_stage = next_stage
        self.action = action

    def _next(self, byte: int, kind: int) -> int:
        pattern, table = self.pattern, self.table
        n = self.matched

        def ok(i: int) -> bool:
            if i >= len(pattern):
                return False
            b, special = pattern[i]
            if b != byte:
                return False
            return kind == TEXT or (special if kind == SPECIAL_TOKEN else not special)

        while n > 0 and not ok(n):
            n = table[n - 1]
        if ok(n):
            n += 1
        return n

    def feed(self, byte: int, kind: int) -> bool:
        k = self.kind
        if k == _MARKER:
            self.matched = self._next(byte, kind)
            return self.matched == len(self.pattern)
        if k == _NEWLINES_AND_MARKER:
            if self.matched == 0 and byte == 10:
                self.newlines += 1
            else:
                nxt = self._next(byte, kind)
                if nxt <= self.matched:
                    self.newlines = 0
                self.matched = nxt
            return self.matched == len(self.pattern)
        # leading newline
        if self.first:
            self.matched = 1 if byte == 10 else 0
        self.first = False
        return self.matched == 1

    def matching_len(self) -> int:
        if self.kind == _NEWLINES_AND_MARKER:
            return self.matched + self.newlines
        return self.matched


class _Markers:
    """Marker patterns derived from the special-token spellings (built once per parser)."""

    def __init__(self, options) -> None:
        tokens = options.special_tokens or DEFAULT_SPECIAL_TOKENS
        dsml = tokens.dsml
        self.dsml_open = _pattern([("<", False), (dsml, True)])
        self.dsml_close = _pattern([("</", False), (dsml, True)])
        self.calls_close = (
            _pattern([("</", False), (dsml, True), ("tool_calls>", False)]),
            _pattern([("</", False), (dsml, True), (" calls>", False)]),
        )
        self.think_end = _pattern([(tokens.thinking_end, True)])
        self.stops = tuple(_plain(s) for s in options.stop_sequences if s)
        self.fence_open = (_plain("```json\n"), _plain("```\n"))
        self.fence_close = _plain("\n```")
        self.invoke = _plain('invoke name="')
        self.quote = _plain('"')
        self.parameter = _plain("parameter name=")
        self.space = _plain(" ")
        self.true_attr = _plain('true">')
        self.false_attr = _plain('false">')
        self.parse_tool_calls = options.parse_tool_calls
        self.parse_json = options.parse_json_output


def _branches(stage: tuple, m: _Markers) -> tuple[list[_Branch], tuple]:
    """The branches and the unmatched action of a stage."""
    name, flag = stage
    b: list[_Branch] = []

    def add(kind, pattern, next_stage, action):
        b.append(_Branch(kind, pattern, next_stage, action))

    def stops():
        for p in m.stops:
            add(_MARKER, p, (S_FINISHED, None), STOP_SEQUENCE)

    if name == S_CONTENT:
        if m.parse_json:
            for p in m.fence_open:
                add(_MARKER, p, (S_JSON, None), SKIP)
            add(_MARKER, _plain("{"), (S_JSON, None), label("{"))
            add(_MARKER, _plain("["), (S_JSON, None), label("["))
        else:
            stops()
        if m.parse_tool_calls:
            add(_NEWLINES_AND_MARKER, m.dsml_open, (S_TOOL_CALLS, None), SKIP)
        if flag:
            add(_LEADING_NEWLINE, (), (S_CONTENT, True), SKIP)
        add(_MARKER, m.think_end, (S_CONTENT, False), SKIP_EXTRA_THINK_END)
        return b, (TO_SPACE if m.parse_json else CONTENT)
    if name == S_JSON:
        stops()
        add(_MARKER, m.fence_close, (S_AFTER_JSON, None), SKIP)
        return b, CONTENT
    if name == S_AFTER_JSON:
        if m.parse_tool_calls:
            add(_NEWLINES_AND_MARKER, m.dsml_open, (S_TOOL_CALLS, None), SKIP)
        return b, TO_SPACE
    if name == S_TOOL_CALLS:
        add(_MARKER, m.invoke, (S_TOOL_NAME, None), TOOL_CALL_BEGIN)
        for p in m.calls_close:
            add(_MARKER, p, (S_FINISHED, None), SKIP)
        return b, SKIP
    if name == S_TOOL_NAME:
        add(_MARKER, m.quote, (S_ARGS, True), TOOL_NAME_END)
        return b, TOOL_NAME
    if name == S_ARGS:
        add(_MARKER, m.parameter, (S_ARG_NAME, None), LABEL_OBJECT_OPEN if flag else LABEL_ARG_SEP)
        add(_MARKER, m.dsml_close, (S_TOOL_CALLS, None), ARGS_END_EMPTY if flag else ARGS_END)
        return b, SKIP
    if name == S_ARG_NAME:
        add(_MARKER, m.space, (S_ARG_STRING_ATTR, None), LABEL_KV_SEP)
        return b, ARGS_TEXT_RAW
    if name == S_ARG_STRING_ATTR:
        add(_MARKER, m.true_attr, (S_ARG_VALUE, True), LABEL_STRING_OPEN)
        add(_MARKER, m.false_attr, (S_ARG_VALUE, False), SKIP)
        return b, SKIP
    if name == S_ARG_VALUE:
        add(_MARKER, m.dsml_close, (S_ARGS, False), LABEL_STRING_CLOSE if flag else SKIP)
        return b, (ARGS_TEXT_STRING if flag else ARGS_TEXT_RAW)
    if name == S_REASONING:
        if m.parse_tool_calls:
            add(_NEWLINES_AND_MARKER, m.dsml_open, (S_TOOL_CALLS, None), SKIP)
        if flag:
            add(_LEADING_NEWLINE, (), (S_REASONING, True), SKIP)
        add(_NEWLINES_AND_MARKER, m.think_end, (S_CONTENT, True), SKIP)
        return b, REASONING
    return b, SKIP_AFTER_FINISHED  # finished


class OutputParser:
    """Incremental parser; `feed(data, kind)` → list of `(action, byte_len)`."""

    __slots__ = ("_m", "stage", "_branches", "_unmatched", "_buffered", "_first_bytes")

    def __init__(self, options) -> None:
        self._m = _Markers(options)
        if options.starts_in_tool_calls:
            stage = (S_TOOL_CALLS, None)
        elif options.thinking_initial_stage is not None:
            v = options.thinking_initial_stage.value
            if v == "ReasoningStart":
                stage = (S_REASONING, True)
            elif v == "ReasoningContinuation":
                stage = (S_REASONING, False)
            else:
                stage = (S_CONTENT, False)
        else:
            stage = (S_CONTENT, True)
        self._enter(stage)

    def _enter(self, stage: tuple) -> None:
        self.stage = stage
        self._branches, self._unmatched = _branches(stage, self._m)
        self._buffered = 0
        # Bytes that can make progress from an idle state (for the fast path).
        first = set()
        for br in self._branches:
            if br.kind == _MARKER:
                first.add(br.pattern[0][0])
            else:
                first.add(10)
                if br.pattern:
                    first.add(br.pattern[0][0])
        self._first_bytes = first

    def _idle(self) -> bool:
        for br in self._branches:
            if br.matched or br.newlines or (br.kind == _LEADING_NEWLINE and br.first):
                return False
        return True

    def feed(self, data: bytes, kind: int) -> list[tuple[tuple, int]]:
        out: list[tuple[tuple, int]] = []
        i, n = 0, len(data)
        while i < n:
            # Fast path: no marker in progress → jump to the next byte that could start one.
            if self._idle():
                first = self._first_bytes
                j = i
                while j < n and data[j] not in first:
                    j += 1
                if j > i:
                    self._buffered += j - i
                    i = j
                    if i >= n:
                        break
            byte = data[i]
            i += 1
            self._buffered += 1
            hit = None
            for br in self._branches:
                if br.feed(byte, kind):
                    hit = br
                    break
            if hit is not None:
                mlen = hit.matching_len()
                if mlen < self._buffered:
                    out.append((self._unmatched, self._buffered - mlen))
                if mlen > 0:
                    out.append((hit.action, mlen))
                self._enter(hit.next_stage)
        mlen = max((br.matching_len() for br in self._branches), default=0)
        if mlen < self._buffered:
            out.append((self._unmatched, self._buffered - mlen))
            self._buffered = mlen
        return out

    def finish(self) -> list[tuple[tuple, int]]:
        if self._buffered > 0:
            return [(self._unmatched, self._buffered)]
        return []
