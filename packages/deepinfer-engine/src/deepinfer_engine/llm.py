"""`LLM`: the offline entry point (vLLM-compatible `generate` / `chat`), with a tqdm bar showing live
prefill/decode tokens per second. Outputs come back in input order."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from deepinfer_engine.chat_stream import ChatDelta, ChatStream, hidden_special_ids
from deepinfer_engine.config import EngineConfig
from deepinfer_engine.engine import LLMEngine
from deepinfer_engine.errors import InputError
from deepinfer_engine.outputs import RequestOutput
from deepinfer_engine.sampling_params import SamplingParams

PromptType = str | Sequence[int] | dict[str, Any]
DeltaCallback = Callable[[int, int, ChatDelta], None]

logger = logging.getLogger(__name__)


def _normalize_prompts(prompts: Any) -> list[tuple[str | None, list[int] | None]]:
    """Accept a string, a token-id list, {"prompt": ...} / {"prompt_token_ids": ...}, or a list of those."""
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        prompts = [list(prompts)]
    out: list[tuple[str | None, list[int] | None]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append((p, None))
        elif isinstance(p, dict):
            if "prompt_token_ids" in p:
                out.append((p.get("prompt"), [int(t) for t in p["prompt_token_ids"]]))
            elif "prompt" in p:
                out.append((str(p["prompt"]), None))
            else:
                raise InputError(f"prompts[{i}]: dict without 'prompt' or 'prompt_token_ids' (keys {sorted(p)})")
        elif isinstance(p, Sequence) and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            out.append((None, list(p)))
        else:
            raise InputError(f"prompts[{i}]: found {type(p).__name__}, expected str, list[int] or a prompt dict")
    return out


class LLM:
    """`LLM(model=DIR, **engine_options)`; with no model the embedded tiny V4.1 checkpoint is used.

    Engine options are the flat names of `EngineConfig` (`max_num_seqs`, `kv_cache_memory_bytes`, `device`, ...);
    an unknown name raises `ConfigError` listing the closest valid ones.
    """

    bar_refresh_s: float = 0.1
    """Seconds between progress-bar redraws while no prompt finishes (live prefill/decode tok/s)."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.config = EngineConfig.from_options(model=model, **engine_options)
        self.engine = LLMEngine.from_config(self.config)
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

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        items = _normalize_prompts(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(items)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise InputError(f"sampling_params: found a list of {len(params)}, expected one per prompt "
                                 f"({len(items)}) or a single SamplingParams")
        ids = self._add(items, params)
        return self._run(ids, use_tqdm=use_tqdm)

    def _add(self, items: list[tuple[str | None, list[int] | None]], params: list[SamplingParams]) -> list[str]:
        """Validate and tokenize everything first, so that a bad input leaves no half-added batch behind."""
        ready: list[tuple[str | None, list[int], SamplingParams]] = []
        for i, ((text, token_ids), sp) in enumerate(zip(items, params)):
            if not isinstance(sp, SamplingParams):
                raise InputError(f"sampling_params[{i}]: found {type(sp).__name__}, expected SamplingParams")
            if token_ids is None:
                token_ids = self.engine.encode_prompt(text)
            self.engine.check_prompt(token_ids, where=f"prompts[{i}]")
            ready.append((text, token_ids, sp))
        ids: list[str] = []
        for text, token_ids, sp in ready:
            rid = str(self._counter)
            self._counter += 1
            self.engine.add_request(rid, token_ids, sp, prompt=text)
            ids.append(rid)
        return ids

    def _run(self, ids: list[str], *, use_tqdm: bool, streams: dict[str, list[ChatStream]] | None = None,
             on_delta: DeltaCallback | None = None) -> list[RequestOutput]:
        """Step until every request of `ids` is done. `streams`: per request id, one ChatStream per sample, fed
        the new token ids after every step (a sample whose stream hit a stop sequence is stopped at once);
        `on_delta(position in ids, sample index, delta)` sees each parsed event as it arrives."""
        done: dict[str, RequestOutput] = {}
        streams = streams or {}
        order = {rid: i for i, rid in enumerate(ids)}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        eng = self.engine
        wanted = set(ids)
        pre0, dec0, t0 = eng.total.prefill_tokens, eng.total.decode_tokens, time.perf_counter()
        shown = t0
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.request_id in streams:
                        self._feed(out, streams[out.request_id], order[out.request_id], on_delta)
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    now = time.perf_counter()
                    dt = max(now - t0, 1e-9)
                    bar.set_postfix_str(f"prefill {(eng.total.prefill_tokens - pre0) / dt:.0f} tok/s, "
                                        f"decode {(eng.total.decode_tokens - dec0) / dt:.0f} tok/s", refresh=False)
                    # tqdm redraws only on update(); the rates must move while prompts are still running
                    if now - shown >= self.bar_refresh_s:
                        bar.refresh()
                        shown = now
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

    def _feed(self, out: RequestOutput, streams: list[ChatStream], position: int,
              on_delta: DeltaCallback | None) -> None:
        for co, stream in zip(out.outputs, streams):
            if stream.num_pushed > len(co.token_ids) or (stream.done and not co.finished):
                continue
            new = co.token_ids[stream.num_pushed:]
            stop_id = co.stop_reason if isinstance(co.stop_reason, int) else None
            deltas = stream.push(new, final=co.finished, stop_token_id=stop_id) if new else []
            if stream.stopped and not co.finished:
                # the recipe matched a stop sequence: no more tokens for this sample
                self.engine.stop_sample(out.request_id, co.index)
            if co.finished:
                deltas += stream.finish(co.finish_reason)
                stream.apply_to(co)
                if co.parse_error is not None:
                    logger.warning("chat output %s[%d]: %s (raw text kept in .text: %r)", out.request_id, co.index,
                                   co.parse_error, co.text)
            if on_delta is not None:
                for d in deltas:
                    on_delta(position, co.index, d)

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
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams(max_tokens=256)] * len(convs)
        else:
            params = list(sampling_params)
        if len(params) != len(convs):
            raise InputError(f"sampling_params: found a list of {len(params)}, expected one per conversation "
                             f"({len(convs)}) or a single SamplingParams")
        renders = [self.render_chat(conv, tools=tools, thinking=thinking, reasoning_effort=reasoning_effort)
                   for conv in convs]
        return self.generate_chat(renders, params, use_tqdm=use_tqdm, on_delta=on_delta,
                                  hide_special_tokens=hide_special_tokens)

    def generate_chat(self, renders: Sequence[_RenderedChat | None], params: Sequence[SamplingParams], *,
                      use_tqdm: bool = True, prompts: Sequence[dict[str, Any]] | None = None,
                      on_delta: DeltaCallback | None = None, hide_special_tokens: bool = False
                      ) -> list[RequestOutput]:
        """Generate rendered chats (and, where `renders[i]` is None, the plain `prompts[i]`) in one batch,
        parsing the chat samples incrementally (see `chat`)."""
        items = _normalize_prompts([{"prompt_token_ids": r.token_ids} if r is not None else prompts[i]
                                    for i, r in enumerate(renders)])
        full = [r.sampling(sp) if r is not None else sp for r, sp in zip(renders, params)]
        ids = self._add(items, full)
        streams: dict[str, list[ChatStream]] = {}
        for rid, r, sp in zip(ids, renders, full):
            if r is not None:
                hidden = (hidden_special_ids(self._added_tokens(), r.request.parsing_options)
                          if hide_special_tokens else frozenset())
                streams[rid] = [ChatStream(r.request, self._recipe_tokenizer(), eos_token_ids=self.engine.eos_token_ids,
                                           hidden_token_ids=hidden) for _ in range(sp.n)]
        return self._run(ids, use_tqdm=use_tqdm, streams=streams, on_delta=on_delta)

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


def llm_from_cli(ns: Any, **overrides: Any) -> LLM:
    """An `LLM` from parsed CLI flags (see `config.add_engine_args`); unset flags keep the defaults."""
    config = EngineConfig.from_cli(ns, **overrides)
    engine = LLMEngine.from_config(config)
    return LLM.from_engine(engine)
