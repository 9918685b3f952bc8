"""Output processor: engine-core deltas -> `RequestOutput`s.

Owns everything between sampled ids and what the caller sees: incremental detokenization (one tokenizer), stop
strings, fan-in of the n samples of a prompt, chat parsing through deepseek-recipe (`ChatStream`) and the one
finish path every sample goes through. It never touches the scheduler or the runner: when it ends a sample
itself (stop string, recipe stop sequence) it lists the sequence in `ProcessedOutputs.reqs_to_abort` and the
caller aborts it in the engine core. Pure Python (no torch).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from deepinfer_engine.chat_stream import ChatDelta, ChatStream
from deepinfer_engine.core.sched_output import EngineCoreOutput
from deepinfer_engine.errors import InputError
from deepinfer_engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from deepinfer_engine.sampling_params import SamplingParams

__all__ = ["ChatSpec", "OutputProcessor", "ProcessedOutputs"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ChatSpec:
    """Parse a request's samples as chat completions: the recipe request its prompt was rendered from, a
    `deepseek_recipe.Tokenizer`, and the added-vocabulary ids a display drops (see ChatStream)."""

    request: Any
    tokenizer: Any
    hidden_token_ids: frozenset[int] = frozenset()


@dataclass(kw_only=True)
class ProcessedOutputs:
    """request_outputs: the RequestOutput of every request that changed (the same object is updated until it is
    finished); reqs_to_abort: engine-core ids the processor finished itself; chat_deltas: (request id, sample
    index, ChatDelta) parsed this step, in order."""

    request_outputs: list[RequestOutput] = field(default_factory=list)
    reqs_to_abort: list[str] = field(default_factory=list)
    chat_deltas: list[tuple[str, int, ChatDelta]] = field(default_factory=list)


@dataclass(kw_only=True)
class _Detok:
    prefix: int = 0  # first id of the decode window
    read: int = 0  # ids before this are in `text`
    text: str = ""


@dataclass(kw_only=True)
class _RequestState:
    output: RequestOutput
    params: SamplingParams
    child_ids: list[str]
    detok: list[_Detok]
    streams: list[ChatStream] | None
    num_done: int = 0
    text_at_finish: bool = False  # decode each sample's text once, when it finishes (add_request's final_only)


class OutputProcessor:
    def __init__(self, *, tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self._requests: dict[str, _RequestState] = {}
        self._children: dict[str, tuple[_RequestState, int]] = {}

    def add_request(self, request_id: str, *, prompt: str | None, prompt_token_ids: Sequence[int],
                    params: SamplingParams, child_ids: Sequence[str], chat: ChatSpec | None = None,
                    final_only: bool = False) -> None:
        """Register a prompt whose samples run in the core as `child_ids` (one per sample, in index order).

        final_only: the caller reads only finished outputs (`LLM.generate`). Without stop strings, which are
        searched in the text as it grows, each sample's text is then decoded once, when it finishes, instead of
        at every step (the same text; unfinished outputs carry none): detokenization was most of the processor's
        time per step (256 requests: ~2 of ~2.3 ms)."""
        for rid in (request_id, *child_ids):
            if rid in self._requests or rid in self._children:
                raise InputError(f"request_id: {rid!r} is already in use")
        n = len(child_ids)
        out = RequestOutput(request_id=request_id, prompt=prompt, prompt_token_ids=list(prompt_token_ids),
                            outputs=[CompletionOutput(index=i) for i in range(n)],
                            metrics=RequestMetrics(arrival_time=time.monotonic()))
        if params.logprobs is not None:
            for co in out.outputs:
                co.logprobs = []
                co.cumulative_logprob = 0.0
        if params.prompt_logprobs is not None:
            out.prompt_logprobs = [None]
        streams = None
        if chat is not None:
            streams = [ChatStream(chat.request, chat.tokenizer, eos_token_ids=self.eos_token_ids,
                                  hidden_token_ids=chat.hidden_token_ids) for _ in range(n)]
        st = _RequestState(output=out, params=params, child_ids=list(child_ids), detok=[_Detok() for _ in range(n)],
                           streams=streams, text_at_finish=final_only and not params.stop)
        self._requests[request_id] = st
        for i, cid in enumerate(child_ids):
            self._children[cid] = (st, i)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def child_ids(self, request_id: str) -> list[str]:
        st = self._requests.get(request_id)
        return [] if st is None else list(st.child_ids)

    def drop(self, request_ids: Iterable[str]) -> list[str]:
        """Forget requests without finishing them (the caller gave up on them); returns their core ids."""
        ids: list[str] = []
        for rid in request_ids:
            st = self._requests.pop(rid, None)
            if st is not None:
                ids.extend(st.child_ids)
                for cid in st.child_ids:
                    self._children.pop(cid, None)
        return ids

    def process(self, deltas: Iterable[EngineCoreOutput]) -> ProcessedOutputs:
        result = ProcessedOutputs()
        touched: dict[str, RequestOutput] = {}
        for d in deltas:
            link = self._children.get(d.req_id)
            if link is None:
                continue  # dropped, or an abort echo of a sample this processor already finished
            st, idx = link
            co = st.output.outputs[idx]
            if co.finish_reason is not None:
                continue
            touched[st.output.request_id] = st.output
            self._apply(st, idx, d, result)
        result.request_outputs = list(touched.values())
        return result

    # ------------------------------------------------------------------ internals
    def _apply(self, st: _RequestState, idx: int, d: EngineCoreOutput, result: ProcessedOutputs) -> None:
        out, co, params = st.output, st.output.outputs[idx], st.params
        if d.new_token_ids:
            if out.metrics.first_token_time is None:
                out.metrics.first_token_time = time.monotonic()
            co.token_ids.extend(d.new_token_ids)
        if co.logprobs is not None:
            for lp in d.new_logprobs:
                co.logprobs.append(lp)
                co.cumulative_logprob = (co.cumulative_logprob or 0.0) + lp.logprob
        if d.new_prompt_logprobs and out.prompt_logprobs is not None and idx == 0:
            out.prompt_logprobs.extend(d.new_prompt_logprobs)
        out.metrics.num_preemptions = max(out.metrics.num_preemptions, d.num_preemptions)
        if d.num_draft_tokens:  # a speculative round
            m = out.metrics
            m.num_draft_tokens += d.num_draft_tokens
            m.num_verified_tokens += d.num_verified_tokens
            m.num_accepted_tokens += d.num_accepted_tokens
            m.num_spec_steps += 1
        if d.num_cached_tokens > out.num_cached_tokens:  # n > 1: the sample that got most from the prefix cache
            out.num_cached_tokens = d.num_cached_tokens
            out.metrics.num_replayed_tokens = d.num_replayed_tokens
        finish, stop_reason = d.finish_reason, d.stop_reason
        # a core "stop" with new ids was ended by its last id (EOS or a stop token id): kept in token_ids, not text
        stopped_by_token = finish == "stop" and bool(d.new_token_ids)
        by_processor = False
        if d.new_token_ids and self.tokenizer is not None and not st.text_at_finish:
            text, hit = self._detokenize(co, params, st.detok[idx], exclude_last=stopped_by_token)
            co.text = text
            # a stop string wins over "length": the token that completed it may also be the last one allowed
            if hit is not None and finish in (None, "length", "stop"):
                by_processor = finish is None
                finish, stop_reason = "stop", hit
        if st.streams is not None and d.new_token_ids:
            stream = st.streams[idx]
            if not stream.done:
                final = finish is not None
                stop_id = stop_reason if isinstance(stop_reason, int) else None
                for delta in stream.push(d.new_token_ids, final=final, stop_token_id=stop_id):
                    result.chat_deltas.append((out.request_id, idx, delta))
            if stream.stopped and finish is None:  # the recipe matched a stop sequence: no more tokens
                finish, stop_reason, by_processor = "stop", None, True
        if finish is not None:
            if st.text_at_finish and self.tokenizer is not None:  # every id at once, as the steps would have
                co.text, _ = self._detokenize(co, params, st.detok[idx], exclude_last=stopped_by_token)
            if by_processor:
                result.reqs_to_abort.append(st.child_ids[idx])
            self._finish_sample(st, idx, finish, stop_reason, d.error, result)

    def _finish_sample(self, st: _RequestState, idx: int, reason: str, stop_reason: int | str | None,
                       error: str | None, result: ProcessedOutputs) -> None:
        """The one finish path of a sample; the request is finished when its last sample is."""
        out, co = st.output, st.output.outputs[idx]
        co.finish_reason = reason
        co.stop_reason = stop_reason
        if error is not None:
            out.error = error
        if st.streams is not None:
            stream = st.streams[idx]
            for delta in stream.finish(reason):
                result.chat_deltas.append((out.request_id, idx, delta))
            stream.apply_to(co)
            if co.parse_error is not None:
                logger.warning("chat output %s[%d]: %s (raw text kept in .text: %r)", out.request_id, idx,
                               co.parse_error, co.text)
        st.num_done += 1
        if st.num_done == len(st.child_ids):
            out.finished = True
            out.metrics.finished_time = time.monotonic()
            self.drop([out.request_id])

    def _detokenize(self, co: CompletionOutput, params: SamplingParams, state: _Detok, *,
                    exclude_last: bool) -> tuple[str, str | None]:
        """Incremental detokenization (decodes a short window per new token, not the whole output) and the
        stop-string search over the newly added text."""
        ids = co.token_ids[:-1] if exclude_last else co.token_ids
        skip = params.skip_special_tokens
        before = len(state.text)
        # byte-level BPE: text of ids[read:end] is only final once decoding it together with a few earlier ids
        # no longer ends in an incomplete UTF-8 sequence (U+FFFD); until then `read` stays, so the ids that complete
        # a character split over several ids decode together with its first bytes. The text up to the furthest
        # such end is the text the ids up to it would add one by one (a byte run's text does not depend on where
        # it is cut), and that end is nearly always the last id: a step costs two decodes however many ids it
        # brought (a speculative round brings several)
        for end in range(len(ids), state.read, -1):
            full = self.tokenizer.decode(ids[state.prefix : end], skip_special_tokens=skip)
            if full.endswith("\ufffd"):
                continue
            prefix = self.tokenizer.decode(ids[state.prefix : state.read], skip_special_tokens=skip)
            state.text += full[len(prefix):]
            state.read = end
            state.prefix = max(state.prefix, end - 4)
            break
        if not params.stop:
            return state.text, None
        longest = max(len(x) for x in params.stop)
        start = max(0, before - longest + 1)
        best: tuple[int, str] | None = None
        for x in params.stop:
            i = state.text.find(x, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, x)
        if best is None:
            return state.text, None
        i, x = best
        return (state.text[: i + len(x)] if params.include_stop_str_in_output else state.text[:i]), x
