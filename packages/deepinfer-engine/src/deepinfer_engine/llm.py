"""`LLM`: the offline entry point (vLLM-compatible `generate` / `chat`), with a tqdm bar showing live
prefill/decode tokens per second. Outputs come back in input order."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.engine import LLMEngine
from deepinfer_engine.errors import InputError
from deepinfer_engine.outputs import RequestOutput
from deepinfer_engine.sampling_params import SamplingParams

PromptType = str | Sequence[int] | dict[str, Any]


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
        # validate and tokenize everything first, so that a bad input leaves no half-added batch behind
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
        return self._run(ids, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], *, use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        eng = self.engine
        wanted = set(ids)
        pre0, dec0, t0 = eng.total.prefill_tokens, eng.total.decode_tokens, time.perf_counter()
        try:
            while eng.has_unfinished_requests():
                for out in eng.step():
                    if out.finished and out.request_id in wanted:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
                if bar is not None:
                    dt = max(time.perf_counter() - t0, 1e-9)
                    bar.set_postfix_str(f"prefill {(eng.total.prefill_tokens - pre0) / dt:.0f} tok/s, "
                                        f"decode {(eng.total.decode_tokens - dec0) / dt:.0f} tok/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]

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
    ) -> list[RequestOutput]:
        """OpenAI-style message lists, rendered by deepseek-recipe for this model's version (V4.1 / V4),
        generated, and parsed back into `reasoning_content` / `content` / `tool_calls` on each output."""
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
        prompts = [{"prompt_token_ids": r.token_ids} for r in renders]
        full = [r.sampling(sp) for sp, r in zip(params, renders)]
        outs = self.generate(prompts, full, use_tqdm=use_tqdm)
        for out, r in zip(outs, renders):
            for co in out.outputs:
                r.parse_into(co, self._recipe_tokenizer())
        return outs

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
        """Messages -> prompt token ids (+ parsing options) through deepseek-recipe, for this model's version."""
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
        return _RenderedChat(token_ids=ids, parsing=request.parsing_options,
                             thinking=request.conversation.thinking_mode, request=request)


class _RenderedChat:
    """A rendered conversation plus what is needed to parse its completion."""

    def __init__(self, *, token_ids: list[int], parsing: Any, thinking: bool, request: Any = None) -> None:
        self.token_ids = token_ids
        self.parsing = parsing
        self.thinking = thinking
        self.request = request

    def sampling(self, sp: SamplingParams) -> SamplingParams:
        # special tokens must survive detokenization so that </think> and tool-call markup can be parsed;
        # the recipe's stop sequences apply to content only, so they are matched here only without thinking
        stops = tuple(sp.stop) + (tuple(self.parsing.stop_sequences or ()) if not self.thinking else ())
        return sp.replace(skip_special_tokens=False, stop=stops or None)

    def parse_into(self, co, tokenizer) -> None:
        """Split the completion into reasoning / content / tool calls.

        Uses the recipe's StreamProcessor when the installed recipe has it; otherwise a minimal split on
        `</think>` (tool-call markup is then left in `content`).
        """
        parsed = _parse_with_recipe(self.request, co.token_ids, tokenizer, co.finish_reason)
        if parsed is not None:
            co.reasoning_content, co.content, co.tool_calls = parsed
            return
        text = co.text.replace("<｜end▁of▁sentence｜>", "")
        if self.thinking:
            reasoning, sep, content = text.partition("</think>")
            co.reasoning_content = reasoning.lstrip("\n")
            co.content = content.lstrip("\n") if sep else ""
        else:
            co.content = text.lstrip("\n")
            co.reasoning_content = None
        co.tool_calls = None


_EOS_IDS = (1,)


def _parse_with_recipe(request, token_ids, tokenizer, finish_reason):
    """(reasoning_content, content, tool_calls) from the recipe's StreamProcessor + ChatCompletionResponse,
    or None when the installed recipe lacks them or fails (then the caller's minimal split is used)."""
    if request is None:
        return None
    try:
        import deepseek_recipe as dr

        ids = list(token_ids)
        if ids and ids[-1] in _EOS_IDS:
            ids = ids[:-1]  # the recipe expects the backend to strip EOS
        reason = dr.InferenceFinishReason.Length if finish_reason == "length" else dr.InferenceFinishReason.Stop
        gen = dr.ChatCompletionRequest.chunk_generator(request, "chatcmpl-deepinfer", "deepinfer")
        proc = dr.StreamProcessor(gen, request.parsing_options, tokenizer)
        chunks = list(proc.push(dr.InferenceChunk.tokens(ids))) if ids else []
        chunks += list(proc.push(dr.InferenceChunk.finish(reason)))
        resp = dr.ChatCompletionResponse("chatcmpl-deepinfer", "deepinfer", 0)
        for c in chunks:
            resp.accumulate(c)
        msg = resp.to_dict()["choices"][0]["message"]
    except Exception:  # noqa: BLE001 - parsing must never lose the generated text; fall back
        return None
    return msg.get("reasoning_content"), msg.get("content"), msg.get("tool_calls")


def llm_from_cli(ns: Any, **overrides: Any) -> LLM:
    """An `LLM` from parsed CLI flags (see `config.add_engine_args`); unset flags keep the defaults."""
    config = EngineConfig.from_cli(ns, **overrides)
    engine = LLMEngine.from_config(config)
    return LLM.from_engine(engine)
