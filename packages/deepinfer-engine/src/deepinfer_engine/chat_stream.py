"""Incremental parsing of one chat completion through deepseek-recipe's `StreamProcessor`.

Generated token ids are pushed as the engine produces them; the recipe decodes them (special tokens are
recognised by id, never shown as text), splits reasoning / content / DSML tool calls and applies the request's
stop sequences. `ChatStream` turns its Chat Completions chunks into small `ChatDelta` events for printing and
accumulates the final assistant message (`ChatCompletionResponse`), which is what the conversation history keeps.

With `hidden_token_ids` (an interactive display), added-vocabulary ids that are not parser markers (placeholders,
role tokens, BOS, ...) are dropped before parsing and counted in `num_hidden`, so no special-token spelling reaches
the printed text; without it the parse is the recipe's exactly (such tokens then appear in `content` as the
official recipe emits them).

If the recipe raises, the stream records `error` (exception type and message) and stops parsing; callers then
show the raw text with that error instead of guessing a split.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["ChatDelta", "ChatStream", "hidden_special_ids"]

_RESPONSE_ID = "chatcmpl-deepinfer"
_MODEL_NAME = "deepinfer"


@dataclass(frozen=True, kw_only=True)
class ChatDelta:
    """One printable event: a reasoning / content text delta, a completed tool call
    (`{"id", "type", "function": {"name", "arguments"}}`), or the finish reason (recipe protocol value:
    stop / length / tool_calls / content_filter)."""

    kind: Literal["reasoning", "content", "tool_call", "finish"]
    text: str = ""
    tool_call: dict[str, Any] | None = None
    finish_reason: str | None = None
    num_hidden: int = 0  # finish only: special-token ids dropped from the display (see ChatStream)


def hidden_special_ids(added_tokens: dict[int, str], parsing_options: Any) -> frozenset[int]:
    """Ids of the added vocabulary (`{id: spelling}`) except the spellings the recipe's parser matches as
    markers (end of thinking, DSML tool-call markup): the ones a display drops."""
    tokens = parsing_options.special_tokens
    markers = {tokens.thinking_end, tokens.dsml}
    return frozenset(i for i, text in added_tokens.items() if text not in markers)


class ChatStream:
    """Parser state of one completion (one `CompletionOutput`) of a rendered chat request.

    `request` is the recipe's `ConversationRequest` the prompt was rendered from, `tokenizer` a
    `deepseek_recipe.Tokenizer`, `eos_token_ids` the engine's EOS ids (stripped: the recipe expects the backend to
    drop the token that ended generation).
    """

    def __init__(self, request: Any, tokenizer: Any, *, eos_token_ids: Sequence[int] = (),
                 hidden_token_ids: frozenset[int] = frozenset()) -> None:
        import deepseek_recipe as dr

        self._dr = dr
        gen = dr.ChatCompletionRequest.chunk_generator(request, _RESPONSE_ID, _MODEL_NAME)
        self._proc = dr.StreamProcessor(gen, request.parsing_options, tokenizer)
        self._response = dr.ChatCompletionResponse(_RESPONSE_ID, _MODEL_NAME, 0)
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._open_call: dict[str, Any] | None = None  # tool call whose arguments are still streaming
        self.error: str | None = None
        self.finish_reason: str | None = None
        self._backend_finished = False
        self.num_pushed = 0  # token ids of the completion consumed so far (pushed, stripped or hidden)
        self._hidden = hidden_token_ids
        self.num_hidden = 0

    @property
    def stopped(self) -> bool:
        """The recipe ended the completion itself (a stop sequence matched): generate no more tokens."""
        return self._proc.finished and not self._backend_finished

    @property
    def done(self) -> bool:
        return self.error is not None or self._proc.finished

    def push(self, token_ids: Sequence[int], *, final: bool = False, stop_token_id: int | None = None
             ) -> list[ChatDelta]:
        """Feed new generated ids. With `final`, a trailing EOS / `stop_token_id` is dropped, not parsed."""
        ids = [int(t) for t in token_ids]
        self.num_pushed += len(ids)
        if final and ids and (ids[-1] in self._eos or ids[-1] == stop_token_id):
            ids = ids[:-1]
        if self._hidden:
            kept = [t for t in ids if t not in self._hidden]
            self.num_hidden += len(ids) - len(kept)
            ids = kept
        if not ids or self.done:
            return []
        return self._run(lambda: self._proc.push(self._dr.InferenceChunk.tokens(ids)))

    def finish(self, engine_finish_reason: str | None) -> list[ChatDelta]:
        """End of generation: flush the parser with the backend's reason ("length" or anything else = stop)."""
        if self.done:
            if self._proc.finished:
                return self._flush_call()
            return []
        self._backend_finished = True
        reason = (self._dr.InferenceFinishReason.Length if engine_finish_reason == "length"
                  else self._dr.InferenceFinishReason.Stop)
        return self._run(lambda: self._proc.push(self._dr.InferenceChunk.finish(reason)))

    def message(self) -> dict[str, Any]:
        """The assistant message parsed so far: role, content, and reasoning_content / tool_calls when present
        (the OpenAI message shape, which the recipe converts back into its AssistantMessage for the next turn)."""
        return self._response.to_dict()["choices"][0]["message"] if self._has_choice() else {
            "role": "assistant", "content": None}

    def apply_to(self, co: Any) -> None:
        """Fill a CompletionOutput's `reasoning_content` / `content` / `tool_calls` / `parse_error`."""
        if self.error is not None:
            co.reasoning_content = co.content = co.tool_calls = None
            co.parse_error = self.error
            return
        msg = self.message()
        co.reasoning_content = msg.get("reasoning_content")
        co.content = msg.get("content")
        co.tool_calls = msg.get("tool_calls")
        co.parse_error = None

    # ------------------------------------------------------------------ internals
    def _has_choice(self) -> bool:
        return bool(self._response.to_dict()["choices"])

    def _run(self, fn) -> list[ChatDelta]:
        try:
            chunks = fn()
        except (RuntimeError, ValueError, TypeError) as exc:  # the recipe's stream errors
            self.error = f"deepseek-recipe could not parse the completion: {type(exc).__name__}: {exc}"
            self._proc.close()
            return []
        return self._deltas(chunks)

    def _deltas(self, chunks: Iterable[Any]) -> list[ChatDelta]:
        out: list[ChatDelta] = []
        for chunk in chunks:
            data = chunk.to_dict()  # read before accumulate(), which consumes the chunk
            self._response.accumulate(chunk)
            for choice in data.get("choices", ()):
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content"):
                    out.append(ChatDelta(kind="reasoning", text=delta["reasoning_content"]))
                for call in delta.get("tool_calls") or ():
                    if "id" in call:  # a new call starts: the previous one is complete
                        out.extend(self._flush_call())
                        self._open_call = {"id": call["id"], "type": call.get("type", "function"),
                                           "function": {"name": call["function"]["name"],
                                                        "arguments": call["function"].get("arguments", "")}}
                    elif self._open_call is not None:
                        self._open_call["function"]["arguments"] += call["function"].get("arguments", "")
                if delta.get("content"):
                    out.extend(self._flush_call())
                    out.append(ChatDelta(kind="content", text=delta["content"]))
                if choice.get("finish_reason") is not None:
                    out.extend(self._flush_call())
                    self.finish_reason = choice["finish_reason"]
                    out.append(ChatDelta(kind="finish", finish_reason=self.finish_reason, num_hidden=self.num_hidden))
        return out

    def _flush_call(self) -> list[ChatDelta]:
        if self._open_call is None:
            return []
        call, self._open_call = self._open_call, None
        return [ChatDelta(kind="tool_call", tool_call=call)]
