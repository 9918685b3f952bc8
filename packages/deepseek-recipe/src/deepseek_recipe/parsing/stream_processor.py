"""`StreamProcessor`: backend chunks (text or token ids) → protocol chunks.

Input chunks (`InferenceChunk`) are decoded (token ids through
`StreamDecoder`), parsed by `OutputParser` into action segments, and the
segments are applied to the buffered source pieces to produce output events
(reasoning, content, tool-call begin/name/arguments, finish) that a protocol
chunk generator turns into Chat Completions / Messages / Responses chunks.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from collections import deque

from .._text import check_opt_text, check_text, describe
from ..options import ParsingOptions
from . import output_parser as P
from .decoder import StreamDecoder

__all__ = [
    "PromptUsage",
    "InferenceFinishReason",
    "InferenceChunk",
    "StreamProcessor",
    "FinishReason",
    "OutputChunk",
]


class PromptUsage:
    """Prompt-side token counts from the backend."""

    __slots__ = ("prompt_tokens", "prompt_cache_hit_tokens")

    def __init__(self, *, prompt_tokens: int = 0, prompt_cache_hit_tokens: int = 0) -> None:
        for name, v in (
            ("prompt_tokens", prompt_tokens),
            ("prompt_cache_hit_tokens", prompt_cache_hit_tokens),
        ):
            if type(v) is not int or v < 0:
                raise ValueError(f"PromptUsage.{name} must be a non-negative int, got {describe(v)}")
        self.prompt_tokens = prompt_tokens
        self.prompt_cache_hit_tokens = prompt_cache_hit_tokens


class InferenceFinishReason(enum.Enum):
    """Backend finish reasons; output parsing determines the protocol finish reason."""

    Stop = "Stop"
    Length = "Length"
    ContentFilter = "ContentFilter"


class FinishReason(enum.Enum):
    Stop = "stop"
    Length = "length"
    ToolCalls = "tool_calls"
    StopSequence = "stop_sequence"
    ContentFilter = "content_filter"
    EndOfStream = "end_of_stream"


class InferenceChunk:
    """One backend update, constructed with `ready`, `text`, `tokens`, or `finish`."""

    __slots__ = (
        "kind",
        "content",
        "token_count",
        "token_ids",
        "logprobs",
        "finish_reason",
        "prompt_usage",
        "system_fingerprint",
    )

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.content = None
        self.token_count = None
        self.token_ids = None
        self.logprobs = None
        self.finish_reason = None
        self.prompt_usage = None
        self.system_fingerprint = None

    @staticmethod
    def ready(
        *, prompt_usage: PromptUsage | None = None, system_fingerprint: str | None = None
    ) -> InferenceChunk:
        if prompt_usage is not None and not isinstance(prompt_usage, PromptUsage):
            raise TypeError(f"prompt_usage must be a PromptUsage or None, got {type(prompt_usage).__name__}")
        c = InferenceChunk("ready")
        c.prompt_usage = prompt_usage or PromptUsage()
        c.system_fingerprint = check_opt_text(system_fingerprint, "InferenceChunk.ready system_fingerprint")
        return c

    @staticmethod
    def text(content: str, token_count: int = 0) -> InferenceChunk:
        content = check_text(content, "text chunk content")
        if type(token_count) is not int or token_count < 0:
            raise ValueError(f"token_count must be a non-negative int, got {describe(token_count)}")
        c = InferenceChunk("text")
        c.content = content
        c.token_count = token_count
        return c

    @staticmethod
    def tokens(token_ids, logprobs=None) -> InferenceChunk:
        """Token ids of one backend output; `logprobs` holds one `(logprob, top_logprobs)` pair per id."""
        c = InferenceChunk("tokens")
        c.token_ids = list(token_ids)
        if logprobs is not None:
            try:
                c.logprobs = [(float(lp), [(int(i), float(v)) for i, v in top]) for lp, top in logprobs]
            except OverflowError:  # float(10**400), int(inf)
                raise ValueError(
                    "logprobs must hold (logprob, [(token id, logprob), ...]) pairs of floats and int ids; "
                    f"a value is out of range in {describe(logprobs)}"
                ) from None
        return c

    @staticmethod
    def finish(finish_reason: InferenceFinishReason) -> InferenceChunk:
        if not isinstance(finish_reason, InferenceFinishReason):
            raise TypeError(f"finish_reason must be an InferenceFinishReason, got {describe(finish_reason)}")
        c = InferenceChunk("finish")
        c.finish_reason = finish_reason
        return c


class OutputChunk:
    """An event handed to a protocol chunk generator: `kind` + fields."""

    __slots__ = (
        "kind",
        "content",
        "logprobs",
        "tool_name",
        "arguments",
        "finish_reason",
        "stop_sequence",
        "completion_tokens",
        "reasoning_tokens",
        "system_fingerprint",
        "prompt_usage",
    )

    def __init__(self, kind: str, **fields) -> None:
        self.kind = kind
        self.content = fields.get("content")
        self.logprobs = fields.get("logprobs")
        self.tool_name = fields.get("tool_name")
        self.arguments = fields.get("arguments")
        self.finish_reason = fields.get("finish_reason")
        self.stop_sequence = fields.get("stop_sequence")
        self.completion_tokens = fields.get("completion_tokens", 0)
        self.reasoning_tokens = fields.get("reasoning_tokens")
        self.system_fingerprint = fields.get("system_fingerprint")
        self.prompt_usage = fields.get("prompt_usage")


def _escape_json_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]


class _Pending:
    """Source pieces not yet attributed, and the segment currently being accumulated."""

    __slots__ = ("chunks", "segment", "tool_name", "previous", "stop_sequence", "has_tool_calls", "reasoning")

    def __init__(self) -> None:
        self.chunks: deque[tuple[bytes, list | None]] = deque()
        self.segment: list | None = None  # [action, byte_len]
        self.tool_name = ""
        self.previous = P.SKIP
        self.stop_sequence: str | None = None
        self.has_tool_calls = False
        self.reasoning: list[str] = []

    def take_piece(self, action: tuple, nbytes: int, out: list) -> None:
        if not self.chunks:
            return
        piece, logprobs = self.chunks.popleft()
        if nbytes < len(piece):
            # Both halves keep the piece's log probabilities, as the reference does.
            self.chunks.appendleft((piece[nbytes:], logprobs))
            piece = piece[:nbytes]
        text = piece.decode("utf-8", errors="replace")
        first = self.previous != action
        self.previous = action
        a = action[0]
        if a == "content":
            out.append(OutputChunk("content", content=text, logprobs=logprobs))
        elif a == "reasoning":
            self.reasoning.append(text)
            out.append(OutputChunk("reasoning", content=text, logprobs=logprobs))
        elif a == "to_space":
            out.append(OutputChunk("content", content=" ", logprobs=logprobs))
        elif a in ("skip", "skip_invalid"):
            pass
        elif a == "stop_sequence":
            self.stop_sequence = (self.stop_sequence or "") + text
        elif a == "tool_call_begin":
            if first:
                out.append(OutputChunk("tool_call_begin"))
        elif a == "tool_name":
            self.tool_name += text
        elif a == "tool_name_end":
            if first:
                self.has_tool_calls = True
                name, self.tool_name = self.tool_name, ""
                out.append(OutputChunk("tool_call_named", tool_name=name))
        elif a == "label_args":
            if first:
                out.append(OutputChunk("arguments", arguments=action[1]))
        elif a == "args_text":
            out.append(OutputChunk("arguments", arguments=_escape_json_string(text) if action[1] else text))
        elif a == "args_end":
            if first:
                out.append(OutputChunk("arguments", arguments=action[1]))
        elif a == "label":
            if first:
                out.append(OutputChunk("content", content=action[1], logprobs=logprobs))

    def _whole(self, seg: list, out: list) -> None:
        while self.chunks and len(self.chunks[0][0]) <= seg[1]:
            n = len(self.chunks[0][0])
            self.take_piece(seg[0], n, out)
            seg[1] -= n

    def apply(self, actions: list, out: list) -> None:
        seg = self.segment
        for action, nbytes in actions:
            if seg is not None:
                if action == seg[0]:
                    seg[1] += nbytes
                else:
                    self._whole(seg, out)
                    if seg[1] > 0:
                        self.take_piece(seg[0], seg[1], out)
                    seg = [action, nbytes]
            else:
                seg = [action, nbytes]
        if seg is not None:
            self._whole(seg, out)
        self.segment = seg


class StreamProcessor:
    """Turns backend chunks into protocol chunks; `push(chunk)` per chunk, `finish()` at the end."""

    def __init__(self, generator, options: ParsingOptions, tokenizer=None) -> None:
        if not isinstance(options, ParsingOptions):
            raise TypeError(f"options must be ParsingOptions, got {type(options).__name__}")
        # A snapshot, validated again: the options object is mutable (e.g. stop_sequences set after creation).
        options = dataclasses.replace(options)
        if not hasattr(generator, "generate"):
            raise TypeError(f"generator must be a chunk generator, got {type(generator).__name__}")
        if tokenizer is not None:
            from ..tokenizer import Tokenizer

            if not isinstance(tokenizer, Tokenizer):
                raise TypeError(
                    f"tokenizer must be a deepseek_recipe.Tokenizer or None, got {type(tokenizer).__name__}"
                )
        self._gen = generator
        self._thinking = options.thinking_initial_stage is not None
        self._decoder = None if tokenizer is None else StreamDecoder(tokenizer)
        self._tokenizer = tokenizer
        self._parser = P.OutputParser(options)
        self._pending = _Pending()
        self._started = False
        self._prompt_usage = PromptUsage()
        self._completion_tokens = 0
        self._backend_finish = None
        self._had_tool_calls = False
        self._stop_sequence: str | None = None
        self._done = False
        self._closed = False

    @property
    def finished(self) -> bool:
        """Whether processing completed normally and the processor remains unclosed."""
        return self._done and not self._closed

    def _start(self, out: list, fingerprint=None) -> None:
        if not self._started:
            out.extend(
                self._gen.generate(
                    OutputChunk("start", system_fingerprint=fingerprint, prompt_usage=self._prompt_usage)
                )
            )
            self._started = True

    def push(self, chunk: InferenceChunk) -> list:
        """Process one chunk; raises RuntimeError after completion/close or on a stream error."""
        if self._closed:
            raise RuntimeError("stream processor is closed")
        if self._done:
            raise RuntimeError("stream processor has finished")
        if not isinstance(chunk, InferenceChunk):
            raise TypeError(f"chunk must be an InferenceChunk, got {type(chunk).__name__}")
        out: list = []
        kind = chunk.kind
        if kind == "ready":
            self._prompt_usage = chunk.prompt_usage
            self._start(out, chunk.system_fingerprint)
            return self._emit(out)
        if kind == "finish":
            self._start(out)
            self._backend_finish = chunk.finish_reason
            self._had_tool_calls = self._pending.has_tool_calls
            self._complete(out)
            return self._emit(out)
        if kind == "text":
            # Checked again here: chunk fields are assignable after construction.
            try:
                content = check_text(chunk.content, "text chunk content", RuntimeError)
            except RuntimeError:
                self._closed = True
                raise
            pieces = [(content.encode("utf-8"), chunk.token_count, P.TEXT, None)] if content else []
        else:
            if self._decoder is None:
                self._closed = True
                raise RuntimeError("token chunk received without a tokenizer")
            try:
                decoded = self._decoder.decode_incrementally(chunk.token_ids, chunk.logprobs)
            except RuntimeError:
                self._closed = True
                raise
            pieces = [
                (
                    d.content.encode("utf-8"),
                    d.token_count,
                    P.SPECIAL_TOKEN if d.is_special_token else P.PLAIN_TOKENS,
                    d.logprobs,
                )
                for d in decoded
            ]
        if not pieces:
            return self._emit(out)
        self._start(out)
        events: list = []
        for data, count, pkind, logprobs in pieces:
            self._completion_tokens += count
            actions = self._parser.feed(data, pkind)
            self._pending.chunks.append((data, logprobs))
            self._pending.apply(actions, events)
            if self._pending.stop_sequence is not None:
                self._stop_sequence = self._pending.stop_sequence
                self._pending.stop_sequence = None
                break
        for e in events:
            out.extend(self._gen.generate(e))
        if self._stop_sequence is not None:
            self._complete(out)
        return self._emit(out)

    def finish(self) -> list:
        """Close the input and flush; repeated calls after completion yield no chunks."""
        if self._closed:
            raise RuntimeError("stream processor is closed")
        if self._done:
            return []
        out: list = []
        self._complete(out)
        return self._emit(out)

    def close(self) -> None:
        """Release processing state without producing successful completion."""
        self._closed = True

    def _complete(self, out: list) -> None:
        self._start(out)
        events: list = []
        self._pending.apply(self._parser.finish(), events)
        for e in events:
            out.extend(self._gen.generate(e))
        if self._stop_sequence is not None:
            reason = FinishReason.StopSequence
        elif self._backend_finish is InferenceFinishReason.Stop:
            reason = FinishReason.ToolCalls if self._had_tool_calls else FinishReason.Stop
        elif self._backend_finish is InferenceFinishReason.Length:
            reason = FinishReason.Length
        elif self._backend_finish is InferenceFinishReason.ContentFilter:
            reason = FinishReason.ContentFilter
        else:
            reason = FinishReason.EndOfStream
        reasoning_tokens = None
        if self._thinking and self._tokenizer is not None:
            reasoning_tokens = self._tokenizer.count_tokens("".join(self._pending.reasoning))
        out.extend(
            self._gen.generate(
                OutputChunk(
                    "finish",
                    finish_reason=reason,
                    stop_sequence=self._stop_sequence,
                    completion_tokens=self._completion_tokens,
                    reasoning_tokens=reasoning_tokens,
                )
            )
        )
        self._done = True

    @staticmethod
    def _emit(out: list) -> list:
        return out
