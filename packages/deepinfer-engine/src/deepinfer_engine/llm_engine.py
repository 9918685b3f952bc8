"""`LLMEngine`: admission (`InputProcessor`) -> engine core (`EngineCore`) -> `OutputProcessor`, in one process.

Requests are validated once, at admission; a prompt with n samples enters the core as n sequences (ids
`"{request_id}#{i}"` when n > 1, each with its own seed) and comes back as one `RequestOutput`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from deepinfer_engine.config import EngineConfig
from deepinfer_engine.core.request import EngineCoreRequest
from deepinfer_engine.engine import EngineCore, mix_seed, model_dir_of, sampler_seed
from deepinfer_engine.input_processor import InputProcessor, ProcessedRequest
from deepinfer_engine.output_processor import ChatSpec, OutputProcessor, ProcessedOutputs
from deepinfer_engine.outputs import RequestOutput

__all__ = ["LLMEngine"]


class LLMEngine:
    def __init__(self, core: EngineCore, *, tokenizer: Any = None, bos_token_id: int | None = 0) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.bos_token_id = bos_token_id
        self.input_processor = InputProcessor(tokenizer=tokenizer, bos_token_id=bos_token_id,
                                              vocab_size=core.vocab_size, eos_token_ids=core.eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer=tokenizer, eos_token_ids=core.eos_token_ids)
        self._arrivals = 0

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLMEngine:
        from deepinfer_engine.model.checkpoint_files import load_tokenizer

        mc = config.model
        # the small files before the weights: a malformed tokenizer fails in a second, not after loading
        tokenizer = (load_tokenizer(mc.tokenizer) if mc.tokenizer
                     else load_tokenizer(model_dir_of(config), required=False))
        from deepinfer_engine import dp

        # data parallelism: N rank processes behind a front-end, or this process as one rank of a torchrun world
        core = dp.core_from_config(config) if dp.uses_data_parallel(config) else EngineCore.from_config(config)
        return cls(core, tokenizer=tokenizer, bos_token_id=getattr(core.args, "bos_token_id", 0))

    # the core's components, for benchmarks, commands and tests
    config = property(lambda self: self.core.config)
    runner = property(lambda self: self.core.runner)
    scheduler = property(lambda self: self.core.scheduler)
    plan = property(lambda self: self.core.plan)
    args = property(lambda self: self.core.args)
    model_dir = property(lambda self: self.core.model_dir)
    max_model_len = property(lambda self: self.core.max_model_len)
    eos_token_ids = property(lambda self: self.core.eos_token_ids)
    total = property(lambda self: self.core.total)

    def spec_stats(self) -> Any:
        return self.core.spec_stats()

    # ------------------------------------------------------------------ admission
    def encode_prompt(self, text: str) -> list[int]:
        return self.input_processor.encode_prompt(text)

    def process_input(self, prompt: Any, params: Any, *, where: str = "prompt",
                      params_where: str = "sampling_params") -> ProcessedRequest:
        """Validate one request against this model (raises InputError); nothing is queued."""
        return self.input_processor.process(prompt, params, where=where, params_where=params_where)

    def add_processed(self, request_id: str, req: ProcessedRequest, *, chat: ChatSpec | None = None,
                      final_only: bool = False) -> None:
        """Queue a request `process_input` accepted (no second validation). final_only: the caller reads only its
        finished RequestOutput (`OutputProcessor.add_request`)."""
        params = req.params
        arrival = self._arrivals
        base_seed = sampler_seed(params.seed) if params.seed is not None else mix_seed(self.config.model.seed, arrival)
        n = params.n
        child_ids = [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]
        self.output_processor.add_request(request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                                          params=params, child_ids=child_ids, chat=chat, final_only=final_only)
        added: list[str] = []
        try:
            for i, cid in enumerate(child_ids):
                # seed of sample i: the request seed itself for n == 1, a derived one per sample otherwise
                self.core.add_request(EngineCoreRequest(
                    request_id=cid, prompt_token_ids=req.prompt_token_ids, sampling=params,
                    seed=base_seed if n == 1 else mix_seed(base_seed, i), max_tokens=params.max_tokens,
                    eos_token_ids=self.core.eos_token_ids, stop_token_ids=tuple(params.stop_token_ids),
                    ignore_eos=params.ignore_eos, min_tokens=params.min_tokens, arrival_index=arrival,
                    use_prefix_cache=params.prompt_logprobs is None))  # every prompt position must be computed
                added.append(cid)
        except BaseException:  # e.g. a sample id already used by another request: add all samples or none
            self.output_processor.drop([request_id])
            self.core.abort_requests(added)
            raise
        self._arrivals += 1

    def add_request(self, request_id: str, prompt: Any, params: Any, *, chat: ChatSpec | None = None) -> None:
        """Validate and queue one request: `prompt` is text, token ids or a prompt dict."""
        self.add_processed(request_id, self.process_input(prompt, params), chat=chat)

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests; their final RequestOutput (finish_reason "abort") comes with the next `step()`."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.core.abort_requests([c for rid in ids for c in self.output_processor.child_ids(rid)])

    def discard(self, request_ids: Sequence[str]) -> None:
        """Abort requests and forget them at once (no final output): leaves the engine clean after a failed call."""
        self.core.abort_requests(self.output_processor.drop(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def close(self) -> None:
        """Release what the core holds beyond memory: a data-parallel core's rank processes (idempotent)."""
        close = getattr(self.core, "close", None)
        if close is not None:
            close()

    # ------------------------------------------------------------------ one step
    def step_outputs(self) -> ProcessedOutputs:
        """One engine-core step through the output processor (RequestOutputs and chat deltas)."""
        processed = self.output_processor.process(self.core.step())
        if processed.reqs_to_abort:
            self.core.abort_requests(processed.reqs_to_abort)
        return processed

    def step(self) -> list[RequestOutput]:
        return self.step_outputs().request_outputs
