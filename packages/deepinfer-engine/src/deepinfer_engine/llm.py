"""`LLM`: the offline entry point (vLLM-compatible `generate` / `chat`), with a tqdm bar showing live
prefill/decode tokens per second. Outputs come back in input order."""

from __future__ import annotations

import logging
import numbers
import os
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal

from deepinfer_engine.chat_stream import ChatDelta, hidden_special_ids
from deepinfer_engine.config import EngineConfig, speculative_options
from deepinfer_engine.errors import InputError
from deepinfer_engine.input_processor import ProcessedRequest
from deepinfer_engine.llm_engine import LLMEngine
from deepinfer_engine.output_processor import ChatSpec
from deepinfer_engine.outputs import RequestOutput
from deepinfer_engine.sampling_params import SamplingParams

PromptType = str | Sequence[int] | dict[str, Any]
DeltaCallback = Callable[[int, int, ChatDelta], None]

logger = logging.getLogger(__name__)


def _as_prompt_list(prompts: Any) -> list[Any]:
    """One prompt (a string, a prompt dict, a list of ints) or a list of prompts -> a list of prompts."""
    if isinstance(prompts, str | dict):
        return [prompts]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, numbers.Number) for t in prompts):
        return [prompts]  # one prompt of ids (a float or bool among them is reported by admission)
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise InputError(f"prompts: found {type(prompts).__name__}, expected a prompt or a list of prompts")
    return list(prompts)


def _params_list(sampling_params: Any, n: int, what: str) -> list[Any]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str | bytes):
        params = list(sampling_params)
        if len(params) != n:
            raise InputError(f"sampling_params: found a list of {len(params)}, expected one per {what} ({n}) "
                             f"or a single SamplingParams")
        return params
    raise InputError(f"sampling_params: found {type(sampling_params).__name__}, expected SamplingParams or a list")


class LLM:
    """`LLM(model=DIR, **engine_options)`; with no model the embedded tiny V4.1 checkpoint is used.

    Engine options are the flat names of `EngineConfig` (`max_num_seqs`, `kv_cache_memory_bytes`, `device`, ...);
    an unknown name raises `ConfigError` listing the closest valid ones. `model` and `tokenizer` may be str or
    os.PathLike.

    Bad input: every request of a `generate` / `chat` call is validated against the model before any of them is
    queued; if one is invalid the call raises `InputError` naming it (`prompts[i]` / `sampling_params[i]`, the
    field, the value found, the expected range) and nothing of that call runs (vLLM's policy); the engine is
    left as it was. A request that is valid but cannot be served (prompt longer than max_model_len, non-finite
    logits, a failing step) finishes with finish_reason "error" and `RequestOutput.error`, and the other requests
    of the call complete normally. If a call is interrupted (an exception, Ctrl-C) its requests are aborted, so the
    next call starts clean.
    """

    bar_refresh_s: float = 0.1
    """Seconds between progress-bar redraws while no prompt finishes (live prefill/decode tok/s)."""

    def __init__(self, model: str | os.PathLike[str] | None = None, **engine_options: Any) -> None:
        if model is not None and isinstance(model, os.PathLike):
            model = os.fspath(model)
        if isinstance(engine_options.get("tokenizer"), os.PathLike):
            engine_options["tokenizer"] = os.fspath(engine_options["tokenizer"])
        if "speculative_config" in engine_options:  # vLLM's dict shape -> the speculative_* options
            engine_options.update(speculative_options(engine_options.pop("speculative_config")))
        self.engine = LLMEngine.from_config(EngineConfig.from_options(model=model, **engine_options))
        self.config = self.engine.config  # as resolved by the engine (e.g. the async_scheduling default)
        self._counter = 0

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        self = cls.__new__(cls)
        self.config = engine.config
        self.engine = engine
        self._counter = 0
        return self

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def close(self) -> None:
        """Stop the engine's rank processes (data_parallel_size > 1 / enable_expert_parallel); idempotent. Also
        done by `with LLM(...) as llm:` and, as a last resort, when the LLM is garbage-collected."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        items = _as_prompt_list(prompts)
        params = _params_list(sampling_params, len(items), "prompt")
        ready = self._admit(items, params)
        ids = self._add(ready)
        return self._run(ids, use_tqdm=use_tqdm)

    def _admit(self, items: Sequence[Any], params: Sequence[Any],
               on_invalid: Literal["raise", "error"] = "raise") -> list[ProcessedRequest | InputError]:
        """Validate every request of a call before any is queued. on_invalid="raise": the first bad one raises
        InputError; "error": its InputError takes its place in the list (reported as an error output)."""
        ready: list[ProcessedRequest | InputError] = []
        for i, (prompt, sp) in enumerate(zip(items, params)):
            try:
                ready.append(self.engine.process_input(prompt, sp, where=f"prompts[{i}]",
                                                       params_where=f"sampling_params[{i}]"))
            except InputError as exc:
                if on_invalid == "raise":
                    raise
                ready.append(exc)
        return ready

    def _next_id(self) -> str:
        rid = str(self._counter)
        self._counter += 1
        return rid

    def _add(self, ready: Sequence[ProcessedRequest | InputError], chats: Sequence[ChatSpec | None] | None = None
             ) -> list[str | RequestOutput]:
        """Queue admitted requests (an InputError in the list becomes a finished error output in its place)."""
        ids: list[str | RequestOutput] = []
        added: list[str] = []
        try:
            for i, req in enumerate(ready):
                rid = self._next_id()
                if isinstance(req, InputError):
                    ids.append(_error_output(rid, str(req)))
                    continue
                # `_run` reads only finished outputs: their text is decoded when they finish
                self.engine.add_processed(rid, req, chat=chats[i] if chats is not None else None, final_only=True)
                added.append(rid)
                ids.append(rid)
        except BaseException:
            self.engine.discard(added)
            raise
        return ids

    def _run(self, ids: list[str | RequestOutput], *, use_tqdm: bool, on_delta: DeltaCallback | None = None
             ) -> list[RequestOutput]:
        """Step until every request of `ids` is done (entries that are already outputs are passed through);
        `on_delta(position in ids, sample index, delta)` sees each parsed chat event as it arrives."""
        done: dict[str, RequestOutput] = {}
        wanted = [i for i in ids if isinstance(i, str)]
        order = {rid: i for i, rid in enumerate(ids) if isinstance(rid, str)}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
            bar.update(len(ids) - len(wanted))
        eng = self.engine
        pre0, dec0, t0 = eng.total.prefill_tokens, eng.total.decode_tokens, time.perf_counter()
        shown = t0
        try:
            while eng.has_unfinished_requests():
                step = eng.step_outputs()
                if on_delta is not None:
                    for rid, index, delta in step.chat_deltas:
                        if rid in order:
                            on_delta(order[rid], index, delta)
                for out in step.request_outputs:
                    if out.finished and out.request_id in order:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    now = time.perf_counter()
                    dt = max(now - t0, 1e-9)
                    spec = eng.spec_stats()
                    bar.set_postfix_str(f"prefill {(eng.total.prefill_tokens - pre0) / dt:.0f} tok/s, "
                                        f"decode {(eng.total.decode_tokens - dec0) / dt:.0f} tok/s"
                                        + (f", accepted len {spec.mean_accepted_length:.2f}" if spec else ""),
                                        refresh=False)
                    # tqdm redraws only on update(); the rates must move while prompts are still running
                    if now - shown >= self.bar_refresh_s:
                        bar.refresh()
                        shown = now
        except BaseException:
            # an interrupted call (a bug, Ctrl-C) must not leave its requests queued for the next call
            eng.discard([rid for rid in wanted if rid not in done])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [i if isinstance(i, RequestOutput) else done[i] for i in ids]

    # ------------------------------------------------------------------ chat through deepseek-recipe
    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        tools: Sequence[dict[str, Any]] | None = None,
        thinking: bool = False,
        reasoning_effort: str | None = None,
        use_tqdm: bool = True,
        on_delta: DeltaCallback | None = None,
        hide_special_tokens: bool = False,
    ) -> list[RequestOutput]:
        """OpenAI-style message lists, rendered by deepseek-recipe for this model's version (V4.1 / V4).

        The generated ids of every sample are parsed incrementally by the recipe's StreamProcessor into
        `reasoning_content` / `content` / `tool_calls` (a recipe stop sequence stops the sample as soon as it
        is generated). `on_delta(conversation index, sample index, ChatDelta)` receives the reasoning / content
        deltas, completed tool calls and the finish reason as they arrive. `hide_special_tokens`: drop generated
        added-vocabulary ids that are not parser markers (for displays; see ChatStream). If the recipe cannot
        parse a sample,
        its `parse_error` names the problem, the parsed fields stay None and `.text` holds the raw text.
        """
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        params = _params_list(sampling_params or SamplingParams(max_tokens=256), len(convs), "conversation")
        renders = [self.render_chat(conv, tools=tools, thinking=thinking, reasoning_effort=reasoning_effort)
                   for conv in convs]
        return self.generate_chat(renders, params, use_tqdm=use_tqdm, on_delta=on_delta,
                                  hide_special_tokens=hide_special_tokens)

    def generate_chat(self, renders: Sequence[_RenderedChat | None], params: Sequence[SamplingParams], *,
                      use_tqdm: bool = True, prompts: Sequence[Any] | None = None,
                      on_delta: DeltaCallback | None = None, hide_special_tokens: bool = False,
                      on_invalid: Literal["raise", "error"] = "raise") -> list[RequestOutput]:
        """Generate rendered chats (and, where `renders[i]` is None, the plain `prompts[i]`) in one batch,
        parsing the chat samples incrementally (see `chat`). on_invalid="error" reports a request that fails
        admission as a finished output with finish_reason "error" instead of raising (batch files)."""
        items = [{"prompt_token_ids": r.token_ids} if r is not None else prompts[i] for i, r in enumerate(renders)]
        full = [r.sampling(sp) if r is not None and isinstance(sp, SamplingParams) else sp
                for r, sp in zip(renders, params)]
        ready = self._admit(items, full, on_invalid)
        chats = [None if r is None else self.chat_spec(r, hide_special_tokens=hide_special_tokens) for r in renders]
        ids = self._add(ready, chats)
        return self._run(ids, use_tqdm=use_tqdm, on_delta=on_delta)

    def chat_spec(self, render: _RenderedChat, *, hide_special_tokens: bool = False) -> ChatSpec:
        """How the engine parses the samples of a rendered chat (`LLMEngine.add_processed(..., chat=)`): the recipe
        request, the recipe tokenizer and, with `hide_special_tokens`, the added-vocabulary ids a display drops."""
        hidden = (hidden_special_ids(self._added_tokens(), render.request.parsing_options)
                  if hide_special_tokens else frozenset())
        return ChatSpec(request=render.request, tokenizer=self._recipe_tokenizer(), hidden_token_ids=hidden)

    def _added_tokens(self) -> dict[int, str]:
        tok = self.engine.tokenizer
        return {} if tok is None else {i: t.content for i, t in tok.get_added_tokens_decoder().items()}

    def _recipe_tokenizer(self):
        tok = getattr(self, "_recipe_tok", None)
        if tok is None:
            from deepseek_recipe import Tokenizer

            path = self.config.model.tokenizer or (self.engine.model_dir and str(self.engine.model_dir))
            if path is None:
                raise InputError("chat: this engine has no tokenizer; pass tokenizer= or a checkpoint directory")
            file = path if str(path).endswith(".json") else f"{path}/tokenizer.json"
            tok = Tokenizer.from_file(file)
            self._recipe_tok = tok
        return tok

    def render_chat(self, conv, *, tools=None, thinking: bool = False, reasoning_effort: str | None = None
                    ) -> _RenderedChat:
        """Messages -> prompt token ids (+ parsing options) through deepseek-recipe, for this model's version.

        Assistant history turns are OpenAI messages (`content`, optional `reasoning_content` / `tool_calls`),
        e.g. `ChatStream.message()` of an earlier turn; the recipe converts them into its AssistantMessage."""
        body: dict[str, Any] = {"model": "deepinfer", "messages": list(conv),
                                "thinking": {"type": "enabled" if thinking else "disabled"}}
        if tools:
            body["tools"] = list(tools)
        if reasoning_effort is not None:
            body["reasoning_effort"] = reasoning_effort
        return self.render_chat_body(body)

    def render_chat_body(self, body: dict[str, Any]) -> _RenderedChat:
        """An OpenAI Chat Completions body -> rendered prompt; its `model` name is accepted as this model.

        Raises the recipe's `ConversionError` (or ValueError) for an invalid body."""
        from deepseek_recipe import ChatCompletionRequest, ConversionOptions, ModelVersion

        arch = getattr(self.engine.args, "arch", "v41")
        version = ModelVersion.DeepseekV41Flash if arch == "v41" else ModelVersion.DeepseekV4Pro
        name = str(body.get("model") or "deepinfer")
        body = {**body, "model": name}
        request = ChatCompletionRequest(body).convert(ConversionOptions().with_model_alias(name, version))
        encoding = request.encoding().with_tokenizer(self._recipe_tokenizer())
        ids = list(encoding.encode(request.conversation))
        return _RenderedChat(token_ids=ids, request=request)


class _RenderedChat:
    """A rendered conversation: prompt ids plus the recipe request whose parsing options parse its completion."""

    def __init__(self, *, token_ids: list[int], request: Any) -> None:
        self.token_ids = token_ids
        self.request = request

    @property
    def thinking(self) -> bool:
        return bool(self.request.conversation.thinking_mode)

    def sampling(self, sp: SamplingParams) -> SamplingParams:
        # keep special tokens in `.text`: it is the raw output shown when parsing fails. The recipe's own stop
        # sequences are applied by its StreamProcessor (content only, not reasoning), which stops the sample.
        return sp.replace(skip_special_tokens=False)


def _error_output(request_id: str, error: str) -> RequestOutput:
    from deepinfer_engine.outputs import CompletionOutput

    return RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=[], finished=True, error=error,
                         outputs=[CompletionOutput(index=0, finish_reason="error")])


def llm_from_cli(ns: Any, **overrides: Any) -> LLM:
    """An `LLM` from parsed CLI flags (see `config.add_engine_args`); unset flags keep the defaults."""
    config = EngineConfig.from_cli(ns, **overrides)
    engine = LLMEngine.from_config(config)
    return LLM.from_engine(engine)
