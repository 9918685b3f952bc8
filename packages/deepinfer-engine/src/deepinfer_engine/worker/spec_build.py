"""The engine's speculative decoder built from its config (`LLM(..., speculative_config=...)`): the DSpark stages
or V4's MTP block as the drafter, the policy, the cost policy's latency curves, the Confidence Head files shipped
beside the weights, and the CUDA graphs the rounds replay (docs/dspark.md "Engine integration")."""

from __future__ import annotations

from typing import Any

import torch
from deepinfer_dspark import DSparkInputError, LatencyModel, SurvivalCalibration, VerifyPolicy
from torch import Tensor

from deepinfer_engine.worker.cuda_graph import verify_row_sizes
from deepinfer_engine.worker.spec_decode import SpecDecoder, cuda_busy
from deepinfer_engine.worker.spec_profile import profile_cost_curves

__all__ = ["CONFIDENCE_FILE", "STS_FILE", "build_spec_decoder", "confidence_files"]


STS_FILE = "dspark_sts.json"
CONFIDENCE_FILE = "dspark_confidence.safetensors"


def confidence_files(model_dir: Any, device: torch.device) -> tuple[dict[str, Any], Tensor | None]:
    """The Confidence Head calibration shipped beside the weights (docs/dspark.md "Confidence heads"):
    (`{"greedy" | "sampling": STS temperature(s)}`, the greedy head `[1, d + r] float32` or None).

    `dspark_sts.json` holds the STS sets of the checkpoint's own head (`sampling`; `greedy` = that head serving
    greedy requests); `dspark_confidence.safetensors` a separate greedy head (`greedy` `[1, d + r]`) and its STS set
    (`greedy_sts` `[N]`, default 1), which then replaces the json's greedy set. Missing files mean none; a
    malformed one raises ConfigError."""
    import json
    from pathlib import Path

    from deepinfer_engine.errors import ConfigError

    if model_dir is None:
        return {}, None
    sts: dict[str, Any] = {}
    sts_file = Path(model_dir) / STS_FILE
    if sts_file.exists():
        try:
            raw = json.loads(sts_file.read_text())
        except json.JSONDecodeError as err:
            raise ConfigError(f"{sts_file}: found invalid JSON ({err}), expected {{\"greedy\" | \"sampling\": "
                              "temperatures}; fix: refit it (scripts/dspark_testbed.py) or delete the file") from err
        if not isinstance(raw, dict):
            raise ConfigError(f"{sts_file}: found {type(raw).__name__}, expected an object; fix: refit or delete it")
        for mode, v in raw.items():
            if mode not in ("greedy", "sampling"):
                continue
            ok = isinstance(v, (int, float)) or (isinstance(v, list) and v and all(isinstance(t, (int, float)) for t in v))
            if not ok:
                raise ConfigError(f"{sts_file}: {mode!r} found {v!r}, expected a temperature or a list of them; "
                                  "fix: refit it (scripts/dspark_testbed.py) or delete the file")
            sts[mode] = tuple(float(t) for t in v) if isinstance(v, list) else float(v)
    head = None
    head_file = Path(model_dir) / CONFIDENCE_FILE
    if head_file.exists():
        from safetensors.torch import load_file

        tensors = load_file(str(head_file))
        head = tensors.get("greedy")
        if head is None or head.dim() not in (1, 2) or not head.dtype.is_floating_point:
            found = None if head is None else f"{tuple(head.shape)} {head.dtype}"
            raise ConfigError(f"{head_file}: tensor 'greedy' found {found}, expected a [1, d + r] float head; "
                              "fix: rebuild it (scripts/dspark_testbed.py build) or delete the file")
        head = head.to(device, torch.float32).reshape(1, -1)
        t = tensors.get("greedy_sts")
        sts["greedy"] = 1.0 if t is None else tuple(float(x) for x in t.reshape(-1).tolist())
    return sts, head


def build_spec_decoder(config: Any, model: Any, cache: Any, *, model_dir: Any, num_pages: int,
                       device: torch.device, graphs: Any = None) -> tuple[SpecDecoder, int]:
    """The engine's speculative decoder for `config.speculative` (method "dspark": the checkpoint's DSpark
    stages behind `StageDrafter`) and the drafts per step the scheduler reserves. ConfigError when the
    checkpoint cannot serve the method or the cache cannot roll back that many drafts. graphs: the engine's
    CudaGraphRunner or None; with it the DSpark draft pass replays its graphs and the cost policy's start-up
    profile times graph-replayed verify steps."""

    from deepinfer_engine.config import affine_latency
    from deepinfer_engine.errors import ConfigError
    from deepinfer_engine.model.dspark_drafter import StageDrafter

    spec = config.speculative
    args = model.args
    if spec.speculative_method == "mtp":
        return _build_mtp(spec, model, cache, graphs)
    if not args.has_dspark or getattr(model, "mtp", None) is None:
        raise ConfigError(
            "speculative_method='dspark': found a checkpoint without DSpark draft stages (dspark_block_size "
            "missing); expected a V4.1 / V4-0731 checkpoint. Fix: leave speculative_method unset"
        )
    block = int(args.dspark_block_size)
    k = spec.num_speculative_tokens or block
    if k > block:
        raise ConfigError(f"num_speculative_tokens: found {k}, expected <= the checkpoint's dspark_block_size {block}")
    if k > cache.slack + 1:
        raise ConfigError(f"num_speculative_tokens: found {k}, expected <= the cache rollback slack + 1 "
                          f"({cache.slack + 1}): a rejected tail must not overwrite rows the next step reads")
    # the cost policy runs lagged: its search overlaps the previous round's target step (VerifyPolicy.lagged)
    policy = VerifyPolicy(kind=spec.speculative_policy, threshold=float(spec.speculative_threshold),
                          lagged=spec.speculative_policy == "cost")
    sts, greedy_head = confidence_files(model_dir, device)
    tables = torch.full((cache.num_slots, 1), -1, dtype=torch.int32, device=device)  # the stages own no pages
    # greedy requests read their own head / STS set per row (DraftHeads.greedy_*), so a mixed batch needs no switch
    try:
        drafter = StageDrafter(model, cache, tables, sts=sts.get("sampling", 1.0), greedy_confidence=greedy_head,
                               greedy_sts=sts.get("greedy"))
    except DSparkInputError as err:
        raise ConfigError(f"{model_dir}: the shipped Confidence Head calibration does not fit this checkpoint "
                          f"({err}); fix: rebuild it for this checkpoint or delete {STS_FILE} / {CONFIDENCE_FILE}") from err
    if graphs is not None:  # the stages' parallel pass (and the Markov sampling) replay a CUDA graph per bucket
        drafter.block_runner = graphs.run_draft
        drafter.proposal_runner = graphs.run_draft_proposal
    if policy.kind in ("threshold", "cost") and drafter.heads.confidence is None:
        raise ConfigError(f"speculative_policy: found {policy.kind!r}, but the checkpoint has no Confidence Head; "
                          "use verify_all")
    latency, batch_latency, online = None, {}, True
    if policy.kind == "cost":
        max_tokens = config.scheduler.max_num_batched_tokens
        fixed = affine_latency(spec.speculative_latency)
        if fixed is not None:
            latency, online = LatencyModel.affine(fixed[0], fixed[1], max_tokens), False
        else:
            latency, batch_latency = profile_cost_curves(model, cache, graphs, config, k, num_pages, device)
    decoder = SpecDecoder(drafter, policy=policy, latency=latency, capture=tuple(args.dspark_target_layer_ids),
                          max_position=int(args.max_position_embeddings), online_latency=online, max_drafts=k,
                          batch_latency=batch_latency)
    if spec.speculative_calibration == "online":
        decoder.calibration = SurvivalCalibration()
    if graphs is not None:  # verify steps replay graphs padded to these shapes (worker/cuda_graph.py)
        decoder.graph_rows = {b: verify_row_sizes(b, k + 1) for b in graphs.batch_sizes}
        decoder.capture_clock = lambda: graphs.stats.capture_s
        decoder.insert_runner = graphs.run_insert  # the draft-ring writes too, one graph per batch bucket
        # the draft pass is then one replay the device runs while the host finishes the step (`launch_ahead`);
        # eagerly (CPU) the pass would run inside the launch, before the bookkeeping it is meant to overlap
        decoder.draft_ahead = True
    if device.type == "cuda":  # the host waits for the drafts there: time to warm the policy's code
        decoder.device_busy = cuda_busy
    return decoder, k


def _build_mtp(spec: Any, model: Any, cache: Any, graphs: Any = None) -> tuple[SpecDecoder, int]:
    """V4's MTP block as a one-token drafter (worker/mtp_draft.py): verify_all only (no Confidence Head)."""
    from deepinfer_engine.errors import ConfigError
    from deepinfer_engine.worker.mtp_draft import MTPDrafter

    args = model.args
    if args.has_dspark or getattr(model, "mtp", None) is None or not int(args.num_nextn_predict_layers):
        raise ConfigError(
            "speculative_method='mtp': found a checkpoint without a V4 MTP block (num_nextn_predict_layers = 0, or "
            "DSpark stages instead); expected a V4-Flash checkpoint. Fix: speculative_method='dspark' for DSpark "
            "checkpoints, or leave it unset"
        )
    k = spec.num_speculative_tokens or 1
    if k != 1:
        raise ConfigError(f"num_speculative_tokens: found {k} with speculative_method='mtp', expected 1 (one MTP "
                          "block drafts one token)")
    if spec.speculative_policy != "verify_all":
        raise ConfigError(f"speculative_policy: found {spec.speculative_policy!r} with speculative_method='mtp', "
                          "expected verify_all (the MTP block has no Confidence Head)")
    drafter = MTPDrafter(model, cache)
    if graphs is not None:  # the block's pass over each step's accepted positions replays a CUDA graph
        drafter.block_runner = graphs.run_mtp
    decoder = SpecDecoder(drafter, policy=VerifyPolicy(kind="verify_all"), latency=None, capture=(),
                          max_position=int(args.max_position_embeddings), max_drafts=1)
    return decoder, 1
