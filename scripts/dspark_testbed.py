"""DSpark testbed: a small V4.1-architecture target trained on a deterministic corpus, its DSpark drafter trained
against the frozen target, written as an official-format checkpoint, then speculative decoding measured per
verification policy (docs/dspark.md "Testbed").

    python scripts/dspark_testbed.py build   --out checkpoints/dspark-testbed   # ~minutes on 1-2 CPU threads
    python scripts/dspark_testbed.py measure --ckpt checkpoints/dspark-testbed --json out.json

Why train at all: with random weights the drafter's acceptance is noise, so no policy comparison means anything.

What is trained (the engine's tiny V4.1 config and model code, unchanged):
- corpus: sentences from a small weighted grammar (counting, random noun phrases, copies, swaps) rendered as text
  and tokenized with the real V4.1 tokenizer. Swaps ("swap A B -> B A") make positions a parallel drafter cannot
  know (it does not see the tokens it sampled two positions earlier), so confidences vary within a block.
- target: next-token cross-entropy over the FULL 129,280-token vocabulary. Only the U tokens the corpus uses are
  ever targets; their head rows are trained and every other head row is held at exactly 0, so the other V - U
  logits are exactly 0 and the full-vocabulary log-sum-exp is logsumexp(subset logits, log(V - U)) (exact and
  cheap). The Markov head's output rows follow the same rule, so the drafter's distribution is exact too.
- drafter (mtp.*: main_proj/main_norm, 3 stages, Markov head, Confidence Head) against the frozen target's
  features: 0.1 * CE(corpus token) + 0.9 * TV(draft, target) + 1.0 * BCE(confidence, 1 - TV), position weights
  exp(-k / N), teacher-forced Markov inputs. The target never changes in this phase.
- both phases run the engine's own module code with autograd on: `Transformer.forward_features`,
  `dspark.insert_context` and `dspark.draft_block` are decorated `torch.no_grad()` for inference; this script
  calls the undecorated functions (`__wrapped__`) so the trained forward is exactly the inference forward.
- the target is trained in fp32 and then rounded to the checkpoint's formats (FP8 e4m3 32x32 blocks, FP4 e2m1
  experts, bf16) before the drafter phase, so the drafter learns the target as the engine loads it; the last
  `draft_qat_fraction` of the drafter's steps run through the same quantization with a straight-through estimator.

The checkpoint is written by the engine's writer (layout, index, config, tokenizer files) with the trained tensors
quantized exactly as the writer quantizes random ones, and is loaded back with `load_model` for measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# --------------------------------------------------------------------------------------------------------------
# corpus
# --------------------------------------------------------------------------------------------------------------
NUMBERS = ("one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
           "seventeen eighteen nineteen twenty").split()
ADJS = "red big old small blue lazy happy quiet".split()
NOUNS = "cat dog bird fox horse mouse king tree".split()
VERBS = "sees likes finds helps watches follows".split()
FRUITS = "apple pear plum grape lemon melon peach cherry".split()


def _zipf_choice(rng: random.Random, items: list[str]) -> str:
    # Weighted (1/(k+1)) so that greedy decoding has a well-defined mode and sampling a real spread.
    return rng.choices(items, weights=[1.0 / (k + 1) for k in range(len(items))])[0]


def corpus_sentences(seed: int, count: int) -> list[str]:
    """`count` sentences of the grammar, deterministic in `seed` (Python's `random.Random`, stable across runs)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        kind = rng.randrange(4)
        if kind == 0:
            start = rng.randrange(10)
            n = rng.randrange(4, 9)
            out.append("count : " + " ".join(NUMBERS[start : start + n]) + " .")
        elif kind == 1:
            a1, n1, v, a2, n2 = (_zipf_choice(rng, xs) for xs in (ADJS, NOUNS, VERBS, ADJS, NOUNS))
            out.append(f"the {a1} {n1} {v} the {a2} {n2} .")
        elif kind == 2:
            xs = [_zipf_choice(rng, FRUITS) for _ in range(3)]
            out.append("say " + " ".join(xs) + " again : " + " ".join(xs) + " .")
        else:
            a, b = _zipf_choice(rng, FRUITS), _zipf_choice(rng, FRUITS)
            out.append(f"swap {a} {b} -> {b} {a} .")
    return out


def tokenize(sentences: list[str], tokenizer_json: Path) -> list[list[int]]:
    import deepseek_recipe as dr

    tok = dr.Tokenizer.from_file(str(tokenizer_json))
    return [tok.encode(" " + s) for s in sentences]


def sequences(token_sentences: list[list[int]], length: int) -> Tensor:
    """`[S, length] int64`: the concatenated sentence stream cut into consecutive windows."""
    stream = [t for ids in token_sentences for t in ids]
    rows = len(stream) // length
    return torch.tensor(stream[: rows * length], dtype=torch.int64).view(rows, length)


# --------------------------------------------------------------------------------------------------------------
# model plumbing
# --------------------------------------------------------------------------------------------------------------
def undecorated(fn: Callable) -> Callable:
    """The function under a `@torch.no_grad()` decorator (torch's decorators keep it as `__wrapped__`)."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        raise RuntimeError(f"{fn!r} has no __wrapped__: cannot run the engine's inference forward with autograd")
    return inner


def stored_round_trip(spec, w: Tensor) -> Tensor:
    """What `w` reads back as after the checkpoint stores it in `spec`'s dtype (quantize, then dequantize)."""
    from deepinfer_kernels.quant import dequant_fp4, dequant_fp8_block, quant_fp4, quant_fp8_block

    if spec.dtype == "f8_e4m3":
        fmt = "ue8m0" if spec.scale.dtype == "f8_e8m0" else None
        q, s = quant_fp8_block(w, spec.scale.block, fmt)
        return dequant_fp8_block(q, s, spec.scale.block).to(w.dtype)
    if spec.dtype == "fp4_e2m1x2":
        q, s = quant_fp4(w, block=spec.scale.block[1])
        return dequant_fp4(q, s, spec.scale.block[1]).to(w.dtype)
    if spec.dtype == "bf16":
        return w.to(torch.bfloat16).to(w.dtype)
    return w


def stored_tensors(spec, w: Tensor) -> dict[str, Tensor]:
    """`{name: stored tensor}` (+ its `.scale`) of a trained logical tensor, quantized as the writer does."""
    from deepinfer_kernels.quant import quant_fp4, quant_fp8_block

    w = w.detach().to(torch.float32).cpu()
    if spec.dtype == "f8_e4m3":
        fmt = "ue8m0" if spec.scale.dtype == "f8_e8m0" else None
        q, s = quant_fp8_block(w, spec.scale.block, fmt)
        return {spec.name: q, spec.scale.name: s}
    if spec.dtype == "fp4_e2m1x2":
        q, s = quant_fp4(w, block=spec.scale.block[1])
        return {spec.name: q, spec.scale.name: s}
    if spec.dtype == "bf16":
        return {spec.name: w.to(torch.bfloat16)}
    if spec.dtype == "f32":
        return {spec.name: w}
    if spec.dtype == "i64":
        return {spec.name: w.to(torch.int64)}
    raise ValueError(f"unsupported stored dtype {spec.dtype!r} for {spec.name}")


class _StraightThroughStore(nn.Module):
    """Parametrization: forward uses the stored (quantized) value, gradients pass straight through."""

    def __init__(self, spec, stacked: bool = False) -> None:
        super().__init__()
        self.spec = spec
        self.stacked = stacked  # routed experts: one [E, out, in] parameter, each slot stored as its own tensor

    def forward(self, w: Tensor) -> Tensor:
        with torch.no_grad():
            r = (torch.stack([stored_round_trip(self.spec, w[e]) for e in range(w.shape[0])]) if self.stacked
                 else stored_round_trip(self.spec, w))
        return w + (r - w).detach()


def quantization_aware(model: nn.Module, names: list[str]) -> None:
    """Make the named parameters read through the checkpoint's quantization (straight-through gradients)."""
    from deepinfer_engine.model.inventory import tensor_inventory
    from deepinfer_engine.model.weight_names import param_to_checkpoint
    from torch.nn.utils import parametrize

    specs = {s.name: s for s in tensor_inventory(model.args)}
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    for name in names:
        p = params[name]
        ck, slot = param_to_checkpoint(name, p.shape[0] if p.dim() else 0)[0]
        spec = specs[ck]
        if spec.dtype in ("f32", "i64", "bf16"):  # bf16 rounding (2^-8 relative) is left to the final round trip
            continue
        owner, _, attr = name.rpartition(".")
        parametrize.register_parametrization(modules[owner], attr, _StraightThroughStore(spec, slot is not None))


def remove_quantization_aware(model: nn.Module) -> None:
    from torch.nn.utils import parametrize

    for mod in model.modules():
        if parametrize.is_parametrized(mod):
            for attr in list(mod.parametrizations.keys()):
                parametrize.remove_parametrizations(mod, attr, leave_parametrized=False)


def dense_cache(model: nn.Module, lens: list[int]):
    from deepinfer_engine.model.cache import ModelCache

    return ModelCache.allocate_dense(model.args, lens, dtype=torch.float32)


def prefill_batch(ids: Tensor, block_tables: Tensor, *, start: Tensor | None = None, logits_rows: Tensor | None = None):
    """ForwardBatch of S sequences `ids [S, L]` in slots 0..S-1 at positions start[s] .. start[s] + L - 1."""
    from deepinfer_engine.model.forward_batch import ForwardBatch

    S, L = ids.shape
    base = torch.zeros(S, dtype=torch.int64) if start is None else start
    pos = (base[:, None] + torch.arange(L)[None, :]).reshape(-1)
    rows = torch.zeros(1, dtype=torch.int64) if logits_rows is None else logits_rows
    return ForwardBatch(input_ids=ids.reshape(-1), positions=pos, query_lens=(L,) * S, slots=tuple(range(S)),
                        block_tables=block_tables, logits_indices=rows)


class Vocab:
    """The U corpus tokens (sorted ids) and the log-count of the V - U tokens whose logits are held at 0."""

    def __init__(self, used: Tensor, vocab_size: int) -> None:
        self.ids = used
        self.index = torch.full((vocab_size,), -1, dtype=torch.int64)
        self.index[used] = torch.arange(used.numel())
        self.log_rest = math.log(vocab_size - used.numel())

    def log_probs(self, logits_sub: Tensor) -> Tensor:
        """`[..., U + 1]` log-probabilities: the U corpus tokens, then the lumped mass of all other tokens."""
        rest = torch.full_like(logits_sub[..., :1], self.log_rest)
        full = torch.cat([logits_sub, rest], dim=-1)
        return full - torch.logsumexp(full, dim=-1, keepdim=True)


def target_log_probs(model: nn.Module, out, vocab: Vocab) -> Tensor:
    """`[T, U + 1]` target log-probs at every row of a forward_features output (V4.1 head collapse)."""
    from deepinfer_engine.model.mhc import hc_pre

    h = model.norm(hc_pre(out.hidden, out.pre_last))
    return vocab.log_probs(h.float() @ model.head.weight[vocab.ids].float().T)


# --------------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------------
def _lr(step: int, steps: int, peak: float, warmup: int = 10) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def _train(params: list[nn.Parameter], steps: int, lr: float, loss_fn: Callable[[int], Tensor],
           on_qat: Callable[[], None] | None, qat_from: int, log: Callable[[str], None], name: str) -> list[float]:
    opt = torch.optim.Adam(params, lr=lr, betas=(0.9, 0.98), eps=1e-9)
    losses = []
    t0 = time.perf_counter()
    for step in range(steps):
        if step == qat_from and on_qat is not None:
            on_qat()
        for group in opt.param_groups:
            group["lr"] = _lr(step, steps, lr)
        with torch.enable_grad():
            loss = loss_fn(step)
            opt.zero_grad(set_to_none=True)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if step % 20 == 0 or step == steps - 1:
            log(f"{name} step {step:4d}/{steps} loss {losses[-1]:.4f} ({time.perf_counter() - t0:.0f} s)")
    return losses


def train_target(model, data: Tensor, vocab: Vocab, *, steps: int, batch: int, lr: float, qat_from: int,
                 seed: int, log: Callable[[str], None]) -> list[float]:
    from deepinfer_engine.model.model import Transformer

    fwd = undecorated(Transformer.forward_features)
    names = [n for n, _ in model.named_parameters() if not n.startswith("mtp.")]
    for n, p in model.named_parameters():
        p.requires_grad_(not n.startswith("mtp."))
    g = torch.Generator().manual_seed(seed)
    L = data.shape[1]

    def loss_fn(step: int) -> Tensor:
        ids = data[torch.randint(data.shape[0], (batch,), generator=g)]
        cache, bt = dense_cache(model, [L] * batch)
        out = fwd(model, prefill_batch(ids, bt), cache, capture=())
        lp = target_log_probs(model, out, vocab).view(batch, L, -1)
        tgt = vocab.index[ids[:, 1:]]
        return -lp[:, :-1].gather(-1, tgt[..., None]).mean()

    params = [p for p in model.parameters() if p.requires_grad]
    return _train(params, steps, lr, loss_fn, lambda: quantization_aware(model, names), qat_from, log, "target")


@torch.no_grad()
def target_pass(model, data: Tensor, vocab: Vocab, chunk: int = 16) -> tuple[Tensor, Tensor]:
    """Frozen target over every training sequence: DSpark features `[S, L, n_targets*d]` and log-probs
    `[S, L, U + 1]` (row t = distribution of token t + 1)."""
    from deepinfer_engine.model.dspark import target_features

    a = model.args
    tids = tuple(a.dspark_target_layer_ids)
    feats, lps = [], []
    for i in range(0, data.shape[0], chunk):
        ids = data[i : i + chunk]
        cache, bt = dense_cache(model, [ids.shape[1]] * ids.shape[0])
        out = model.forward_features(prefill_batch(ids, bt), cache, capture=tids)
        feats.append(target_features(out.features, tids).view(*ids.shape, -1))
        lps.append(target_log_probs(model, out, vocab).view(*ids.shape, -1))
    return torch.cat(feats), torch.cat(lps)


def draft_batches(model, data: Tensor, feats: Tensor, seqs: Tensor, anchors: Tensor):
    """(context batch, context features, block batch, cache) for blocks anchored at data[seqs[j], anchors[j]]."""
    from deepinfer_engine.model.dspark import draft_block_ids
    from deepinfer_engine.model.forward_batch import ForwardBatch

    a = model.args
    W, N = a.sliding_window, a.dspark_block_size
    B = seqs.numel()
    cache, bt = dense_cache(model, [data.shape[1]] * B)
    ctx_ids, ctx_pos, ctx_feat, lens = [], [], [], []
    for s, p in zip(seqs.tolist(), anchors.tolist()):
        lo = max(0, p - W)
        ctx_ids.append(data[s, lo:p])
        ctx_pos.append(torch.arange(lo, p))
        ctx_feat.append(feats[s, lo:p])
        lens.append(p - lo)
    ctx = ForwardBatch(input_ids=torch.cat(ctx_ids), positions=torch.cat(ctx_pos), query_lens=tuple(lens),
                       slots=tuple(range(B)), block_tables=bt, logits_indices=torch.zeros(1, dtype=torch.int64))
    blk = ForwardBatch(
        input_ids=draft_block_ids(data[seqs, anchors], N, a.dspark_noise_token_id),
        positions=(anchors[:, None] + torch.arange(N)[None, :]).reshape(-1),
        query_lens=(N,) * B, slots=tuple(range(B)), block_tables=bt,
        logits_indices=torch.zeros(1, dtype=torch.int64),
    )
    return ctx, torch.cat(ctx_feat), blk, cache


def draft_losses(model, data, feats, tlp, vocab: Vocab, seqs: Tensor, anchors: Tensor) -> dict[str, Tensor]:
    """DSpark training objective on a batch of blocks (teacher-forced Markov inputs = corpus tokens)."""
    from deepinfer_engine.model import dspark

    a = model.args
    N = a.dspark_block_size
    B = seqs.numel()
    ctx, ctx_feat, blk, cache = draft_batches(model, data, feats, seqs, anchors)
    undecorated(dspark.insert_context)(model, ctx, cache, ctx_feat)
    out = undecorated(dspark.draft_block)(model, blk, cache)
    last = model.mtp[-1]
    hidden = out.hidden.view(B, N, -1)
    u = last.norm(out.hidden).float() @ model.head.weight[vocab.ids].float().T  # [B*N, U]
    cols = anchors[:, None] + torch.arange(N)[None, :]  # positions p .. p+N-1: prev tokens / target rows
    prev = data[seqs[:, None], cols]  # [B, N]
    e = last.markov_head.w1[prev]  # [B, N, r]
    bias = e.float() @ last.markov_head.w2[vocab.ids].float().T  # [B, N, U]
    q_log = vocab.log_probs(u.view(B, N, -1) + bias)  # [B, N, U + 1]
    p_log = tlp[seqs[:, None], cols]  # target rows p+i predict token p+i+1
    tv = 0.5 * (q_log.exp() - p_log.exp()).abs().sum(-1)  # [B, N]
    nxt = vocab.index[data[seqs[:, None], cols + 1]]
    ce = -q_log.gather(-1, nxt[..., None]).squeeze(-1)
    conf = last.confidence_head(hidden.reshape(B * N, -1), e.reshape(B * N, -1)).view(B, N)
    bce = F.binary_cross_entropy(conf.clamp(1e-6, 1 - 1e-6), (1 - tv).detach().clamp(0, 1), reduction="none")
    w = torch.exp(-torch.arange(N, dtype=torch.float32) / N)
    w = w / w.sum()
    return {"ce": (ce * w).sum(1).mean(), "tv": (tv * w).sum(1).mean(), "conf": (bce * w).sum(1).mean()}


def train_draft(model, data: Tensor, feats: Tensor, tlp: Tensor, vocab: Vocab, *, steps: int, blocks: int,
                lr: float, qat_from: int, seed: int, log: Callable[[str], None]) -> list[float]:
    a = model.args
    N = a.dspark_block_size
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith("mtp."))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(seed)
    L = data.shape[1]

    def loss_fn(step: int) -> Tensor:
        seqs = torch.randint(data.shape[0], (blocks,), generator=g)
        anchors = torch.randint(1, L - N, (blocks,), generator=g)  # targets p+1 .. p+N stay inside the row
        parts = draft_losses(model, data, feats, tlp, vocab, seqs, anchors)
        return 0.1 * parts["ce"] + 0.9 * parts["tv"] + 1.0 * parts["conf"]

    params = [p for p in model.parameters() if p.requires_grad]
    return _train(params, steps, lr, loss_fn, lambda: quantization_aware(model, names), qat_from, log, "draft")


# --------------------------------------------------------------------------------------------------------------
# build: corpus -> target -> drafter -> checkpoint
# --------------------------------------------------------------------------------------------------------------
BUILD_DEFAULTS = {
    "seed": 0, "sentences": 3000, "seq_len": 64,
    "target_steps": 150, "target_batch": 8, "target_lr": 6e-3,
    "draft_steps": 150, "draft_blocks": 64, "draft_lr": 5e-3,
    "target_qat_fraction": 0.0, "draft_qat_fraction": 0.2,
    "calib_prompts": 64, "calib_tokens": 48,
}


def _round_trip_params(model: nn.Module, prefix_draft: bool) -> None:
    """Replace parameters by what the checkpoint will store (so the next phase sees the loaded model)."""
    from deepinfer_engine.model.inventory import tensor_inventory

    specs = {s.name: s for s in tensor_inventory(model.args)}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.startswith("mtp.") == prefix_draft and n in specs:
                p.copy_(stored_round_trip(specs[n], p))


def write_trained_checkpoint(model: nn.Module, config: dict, out: Path) -> None:
    """The engine's writer lays out the checkpoint (shards, index, config, tokenizer files); every shard is then
    rewritten with the trained tensors, quantized as the writer quantizes (same names, shapes, dtypes, shards)."""
    from deepinfer_engine.model.checkpoint import INDEX_FILE
    from deepinfer_engine.model.inventory import tensor_inventory
    from deepinfer_engine.model.loader import expected_checkpoint_tensors
    from deepinfer_engine.model.writer import write_checkpoint
    from safetensors.torch import load_file, save_file

    write_checkpoint(out, config, seed=0, overwrite=True)
    weight_map = json.loads((out / INDEX_FILE).read_text())["weight_map"]
    state = model.state_dict()
    where = expected_checkpoint_tensors(model)  # checkpoint name -> (parameter, expert slot of a stacked one)
    by_file: dict[str, dict[str, Tensor]] = {}
    written: dict[str, dict[str, Tensor]] = {}
    for spec in tensor_inventory(model.args):
        fname = weight_map[spec.name]
        if spec.name in where:
            pname, slot = where[spec.name]
            value = state[pname] if slot is None else state[pname][slot]
            by_file.setdefault(fname, {}).update(stored_tensors(spec, value))
            continue
        # a tensor the checkpoint format lists but the model does not use: keep the writer's own value
        if fname not in written:
            written[fname] = load_file(str(out / fname))
        names = [spec.name] + ([spec.scale.name] if spec.scale is not None else [])
        by_file.setdefault(fname, {}).update({n: written[fname][n] for n in names})
    for fname, tensors in by_file.items():
        if set(tensors) != {k for k, v in weight_map.items() if v == fname}:
            raise RuntimeError(f"{fname}: trained tensors do not match the writer's shard layout")
        save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, str(out / fname),
                  metadata={"format": "pt"})


def build(out: Path, *, threads: int = 1, force: bool = False, log: Callable[[str], None] = print,
          **kw: object) -> dict:
    """Deterministically build the trained testbed checkpoint into `out` (skipped when `out/testbed.json` records
    the same settings, unless `force`); returns the summary dict."""
    from deepinfer_engine.model.loader import load_model
    from deepinfer_engine.model.presets import tiny_v41_config
    from deepinfer_engine.model.writer import write_checkpoint

    cfg = {**BUILD_DEFAULTS, **kw}
    done = out / "testbed.json"
    if not force and done.is_file() and json.loads(done.read_text()).get("settings") == cfg:
        log(f"{out}: already built with these settings (testbed.json); pass force=True / --force to rebuild")
        return json.loads(done.read_text())
    torch.set_num_threads(threads)
    torch.manual_seed(int(cfg["seed"]))
    t0 = time.perf_counter()
    config = tiny_v41_config()
    out.mkdir(parents=True, exist_ok=True)
    write_checkpoint(out, config, seed=int(cfg["seed"]), overwrite=True)  # initial weights + tokenizer files
    model = load_model(out, dtype=torch.float32, quantized=False)  # dense float weights: trainable
    a = model.args
    data = sequences(tokenize(corpus_sentences(int(cfg["seed"]), int(cfg["sentences"])), out / "tokenizer.json"),
                     int(cfg["seq_len"]))
    vocab = Vocab(torch.unique(data), a.vocab_size)
    with torch.no_grad():  # every logit outside the corpus vocabulary is exactly 0 (module docstring)
        keep = torch.zeros(a.vocab_size, dtype=torch.bool)
        keep[vocab.ids] = True
        model.head.weight[~keep] = 0
        model.mtp[-1].markov_head.w2[~keep] = 0
    log(f"corpus: {data.shape[0]} x {data.shape[1]} tokens, {vocab.ids.numel()} distinct ids")
    ts = int(cfg["target_steps"])
    t_losses = train_target(model, data, vocab, steps=ts, batch=int(cfg["target_batch"]), lr=float(cfg["target_lr"]),
                            qat_from=int(ts * (1 - float(cfg["target_qat_fraction"]))), seed=int(cfg["seed"]) + 1, log=log)
    remove_quantization_aware(model)
    _round_trip_params(model, prefix_draft=False)
    feats, tlp = target_pass(model, data, vocab)
    ds = int(cfg["draft_steps"])
    d_losses = train_draft(model, data, feats, tlp, vocab, steps=ds, blocks=int(cfg["draft_blocks"]),
                           lr=float(cfg["draft_lr"]), qat_from=int(ds * (1 - float(cfg["draft_qat_fraction"]))),
                           seed=int(cfg["seed"]) + 2, log=log)
    remove_quantization_aware(model)
    _round_trip_params(model, prefix_draft=True)
    write_trained_checkpoint(model, config, out)
    calib = calibrate_confidence(out, cfg, log=log)
    summary = {"settings": cfg, "threads": threads, "seconds": round(time.perf_counter() - t0, 1),
               "confidence_calibration": calib,
               "target_loss_last10": sum(t_losses[-10:]) / 10, "draft_loss_last10": sum(d_losses[-10:]) / 10,
               "corpus_tokens": int(data.numel()), "corpus_vocab": int(vocab.ids.numel())}
    (out / "testbed.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


# --------------------------------------------------------------------------------------------------------------
# measure: speculative decoding on the trained checkpoint, per policy
# --------------------------------------------------------------------------------------------------------------
def _varlen_batch(tokens: list[Tensor], starts: Tensor, block_tables: Tensor, slots: Tensor | None = None):
    """Sequences `tokens[i]` at positions starts[i].. in cache slots `slots` (default 0..S-1), all rows' logits."""
    from deepinfer_engine.model.forward_batch import ForwardBatch

    lens = [int(t.numel()) for t in tokens]
    ids = torch.cat(tokens)
    pos = torch.cat([int(s) + torch.arange(n) for s, n in zip(starts.tolist(), lens)])
    sl = torch.arange(len(lens)) if slots is None else slots
    return ForwardBatch(input_ids=ids, positions=pos, query_lens=tuple(lens), slots=tuple(sl.tolist()),
                        block_tables=block_tables[sl], logits_indices=torch.arange(ids.numel()))


def _sample_rows(logits: Tensor, temperature: float, seeds: Tensor, positions: Tensor) -> Tensor:
    """Target token per row: argmax at temperature 0, else inverse-CDF with the round's DRAW_FINAL uniform."""
    from deepinfer_dspark import DRAW_FINAL, counter_uniforms, probs_from_logits

    if temperature == 0:
        return logits.argmax(-1)
    p = probs_from_logits(logits, temperature)
    u = counter_uniforms(seeds, positions, DRAW_FINAL)
    cdf = torch.cumsum(p, -1)
    return torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1).clamp(max=p.shape[-1] - 1)


@torch.no_grad()
def generate(model, prompts: Tensor, new_tokens: int, *, policy=None, latency=None, temperature: float = 0.0,
             seed: int = 0, online: bool = True, heads: dict | None = None,
             record: Callable[..., None] | None = None) -> dict:
    """Decode `new_tokens` per prompt; `policy` None = plain autoregressive decoding (the reference), else
    DSpark speculation with that verification policy. Returns tokens [B, new_tokens], stats and timings.

    heads: StageDrafter keyword arguments (sts, greedy_confidence, greedy_sts; `shipped_heads`), default none.
    record(block, proposal, anchor_ids, accept_result): called after every verification (calibration data)."""
    from deepinfer_dspark import (
        AcceptanceStats,
        probs_from_logits,
        sample_block,
        schedule_verification,
        verify,
    )
    from deepinfer_dspark import verify_counter_uniforms as vcu
    from deepinfer_engine.model.dspark import insert_context, target_features
    from deepinfer_engine.model.dspark_drafter import StageDrafter

    a = model.args
    N, tids = a.dspark_block_size, tuple(a.dspark_target_layer_ids)
    B, P = prompts.shape
    cache, bt = dense_cache(model, [P + new_tokens + N + 2] * B)
    seeds = torch.arange(B, dtype=torch.int64) * 7919 + seed
    t0 = time.perf_counter()
    batch = _varlen_batch(list(prompts), torch.zeros(B, dtype=torch.int64), bt)
    out = model.forward_features(batch, cache, capture=tids if policy else ())
    if policy is not None:
        insert_context(model, batch, cache, target_features(out.features, tids))
    rows = torch.arange(B) * P + P - 1
    anchor = _sample_rows(out.logits[rows], temperature, seeds, torch.full((B,), P - 1))
    pos = torch.full((B,), P, dtype=torch.int64)
    result = torch.full((B, new_tokens + N + 1), -1, dtype=torch.int64)
    result[:, 0] = anchor
    count = torch.ones(B, dtype=torch.int64)
    stats = AcceptanceStats(N)
    drafter = StageDrafter(model, cache, bt, **(heads or {})) if policy is not None else None
    temp = torch.full((B,), float(temperature))
    target_seconds = 0.0
    steps = 0
    while bool((count < new_tokens).any()):
        steps += 1
        act = (count < new_tokens).nonzero().squeeze(1)  # finished requests leave the batch
        n = act.numel()
        if policy is None:
            t1 = time.perf_counter()
            out = model.forward_features(_varlen_batch(list(anchor[act, None]), pos[act], bt, act), cache)
            target_seconds += time.perf_counter() - t1
            anchor[act] = _sample_rows(out.logits, temperature, seeds[act], pos[act])
            pos[act] += 1
            result[act, count[act]] = anchor[act]
            count[act] += 1
            continue
        drafter.slots = act
        block = drafter.draft_block(anchor[act], pos[act])  # = propose(...), with the block kept for `record`
        prop = sample_block(block, drafter.heads, anchor[act], pos[act], temperature=temp[act], seeds=seeds[act])
        m = schedule_verification(policy, torch.full((n,), N), survival=prop.survival(), latency=latency,
                                  deterministic=temperature == 0)
        seq = torch.cat([anchor[act, None], prop.draft_ids], 1)
        vb = _varlen_batch([seq[b, : int(m[b]) + 1] for b in range(n)], pos[act], bt, act)
        t1 = time.perf_counter()
        out = model.forward_features(vb, cache, capture=tids)
        dt = time.perf_counter() - t1
        target_seconds += dt
        if online and latency is not None:
            latency.observe(vb.num_tokens, dt)
        target = out.logits if temperature == 0 else probs_from_logits(out.logits, temperature)
        res = verify(target, prop, m, greedy=temperature == 0, uniforms=vcu(seeds[act], pos[act], N))
        stats.update(res.num_accepted, m, confidence=prop.confidence if temperature > 0 else None,
                     accept_prob=res.accept_prob if temperature > 0 else None)
        if record is not None:
            record(block, prop, anchor[act], res)
        # the drafter's context: target features of the accepted positions pos .. pos + a (rows 0 .. a)
        acc = res.num_accepted
        starts = torch.cumsum(m + 1, 0) - (m + 1)
        keep = torch.cat([starts[b] + torch.arange(int(acc[b]) + 1) for b in range(n)])
        ctx = _varlen_batch([seq[b, : int(acc[b]) + 1] for b in range(n)], pos[act], bt, act)
        insert_context(model, ctx, cache, target_features(out.features, tids)[keep])
        emitted = acc + 1
        for k in range(N + 1):
            ok = k < emitted
            result[act[ok], (count[act] + k)[ok]] = res.output_ids[ok, k]
        count[act] += emitted
        anchor[act] = res.next_anchors()
        pos[act] += emitted
    seconds = time.perf_counter() - t0
    return {"tokens": result[:, :new_tokens], "stats": stats, "steps": steps, "seconds": seconds,
            "target_seconds": target_seconds, "generated": int(count.clamp(max=new_tokens).sum())}


def profile_latency(model, batch: int, *, ema: float):
    """`LatencyModel.profile` of the target forward of `batch` requests at Q = batch * (1 .. N + 1) tokens."""
    from deepinfer_dspark import LatencyModel

    a = model.args
    N = a.dspark_block_size
    cache, bt = dense_cache(model, [64 + N + 1] * batch)
    ids = torch.full((batch, 64), 100, dtype=torch.int64)
    model.forward_features(prefill_batch(ids, bt), cache)

    def step(q: int) -> None:
        per = q // batch
        toks = [torch.full((per,), 100, dtype=torch.int64)] * batch
        model.forward_features(_varlen_batch(toks, torch.full((batch,), 64), bt), cache)

    return LatencyModel.profile(step, [batch * k for k in range(1, N + 2)], warmup=1, repeats=5, ema=ema)


def _fit_logistic(x: Tensor, y: Tensor, weight: Tensor, init: Tensor, *, l2: float = 1e-4) -> Tensor:
    """Weights w of sigmoid(x . w) (no bias, as the Confidence Head) by weighted BCE + l2 * |w|^2: float64 L-BFGS
    from `init`, deterministic on the CPU."""
    x64, y64, w8 = x.double(), y.double(), weight.double()
    w = init.double().reshape(-1).clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w], max_iter=300, line_search_fn="strong_wolfe", tolerance_grad=1e-10,
                            tolerance_change=1e-14)

    def closure() -> Tensor:
        opt.zero_grad()
        bce = F.binary_cross_entropy_with_logits(x64 @ w, y64, reduction="none")
        loss = (bce * w8).sum() / w8.sum().clamp(min=1) + l2 * (w * w).sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        opt.step(closure)
    return w.detach().float()


def rollout_records(model, prompts: Tensor, new_tokens: int, temperature: float, seed: int) -> dict[str, Tensor]:
    """verify_all speculation over `prompts`: every round's Confidence Head input x = [h_i ; W1[prev_i]]
    `[M, N, d + r]`, accepted drafts `[M]` and the analytic acceptance sum_v min(p, q) `[M, N]` (sampling)."""
    from deepinfer_dspark import VerifyPolicy

    w1 = model.mtp[-1].markov_head.w1
    xs, accs, aps = [], [], []

    def record(block, prop, anchors, res) -> None:
        prev = torch.cat([anchors[:, None], prop.draft_ids[:, :-1]], 1)
        xs.append(torch.cat([block.hidden.float(), w1[prev].float()], -1))
        accs.append(res.num_accepted.clone())
        aps.append(res.accept_prob.clone() if res.accept_prob is not None else torch.zeros(prev.shape))

    generate(model, prompts, new_tokens, policy=VerifyPolicy(kind="verify_all"), temperature=temperature, seed=seed,
             record=record)
    return {"x": torch.cat(xs), "accepted": torch.cat(accs), "accept_prob": torch.cat(aps)}


def calibrate_confidence(ckpt: Path, cfg: dict, log: Callable[[str], None] = print) -> dict:
    """Fit the Confidence Heads on the regime they serve and write them beside the checkpoint (docs/dspark.md
    "Confidence heads"): verify_all speculation of the loaded checkpoint on training-corpus prompts, at
    temperature 0 and 1, gives every round's head input and outcome.

    - greedy head (`dspark_confidence.safetensors`: `greedy [1, d + r]`, `greedy_sts [N]`): logistic regression of
      the conditional greedy acceptance (draft i == target argmax, on the rounds whose drafts before i were all
      accepted), so cumprod(c) is the survival the policies rank and sum.
    - STS sets of the checkpoint's own head (trained on 1 - TV with the drafter; `dspark_sts.json`): `sampling`
      against the analytic acceptance sum_v min(p, q), `greedy` against greedy acceptance (used only when the
      greedy head file is absent)."""
    from deepinfer_dspark import fit_sts
    from deepinfer_engine.model.loader import load_model
    from safetensors.torch import save_file

    model = load_model(ckpt, dtype=torch.float32)
    n = model.args.dspark_block_size
    prompts = sequences(tokenize(corpus_sentences(int(cfg["seed"]), int(cfg["sentences"])), ckpt / "tokenizer.json"),
                        16)[: int(cfg["calib_prompts"])]
    w_ckpt = model.mtp[-1].confidence_head.proj.weight.detach().float().reshape(-1)
    idx = torch.arange(n)[None, :]
    out = {}
    for temp in (0.0, 1.0):
        r = rollout_records(model, prompts, int(cfg["calib_tokens"]), temp, int(cfg["seed"]))
        y = (r["accepted"][:, None] > idx).double()
        reached = r["accepted"][:, None] >= idx
        out[temp] = (r, y, reached)
    r0, y0, reached0 = out[0.0]
    w_greedy = _fit_logistic(r0["x"][reached0], y0[reached0], torch.ones(int(reached0.sum())), w_ckpt)
    greedy_sts = fit_sts(r0["x"] @ w_greedy, y0, reached0)
    r1, _, reached1 = out[1.0]
    sts = {"sampling": list(fit_sts(r1["x"] @ w_ckpt, r1["accept_prob"].clamp(0, 1), reached1)),
           "greedy": list(fit_sts(r0["x"] @ w_ckpt, y0, reached0))}
    save_file({"greedy": w_greedy.reshape(1, -1).contiguous(),
               "greedy_sts": torch.tensor(greedy_sts, dtype=torch.float32)},
              str(ckpt / "dspark_confidence.safetensors"), metadata={"format": "pt"})
    (ckpt / "dspark_sts.json").write_text(json.dumps(sts) + "\n")
    summary = {"rounds_greedy": int(r0["x"].shape[0]), "rounds_sampling": int(r1["x"].shape[0]),
               "greedy_sts": list(greedy_sts), **{f"sts_{k}": v for k, v in sts.items()}}
    log(f"confidence calibration: {summary}")
    return summary


def shipped_heads(ckpt: Path, which: str = "shipped") -> dict:
    """StageDrafter keyword arguments from the calibration files beside `ckpt` (what the engine loads):
    "shipped" = greedy head + STS sets, "checkpoint" = the checkpoint's head alone with its STS sets, "raw" =
    the checkpoint's head uncalibrated."""
    from deepinfer_engine.worker.spec_build import STS_FILE, confidence_files

    if which == "raw":
        return {}
    sts, head = confidence_files(ckpt, torch.device("cpu"))
    if which == "checkpoint":
        raw = json.loads((ckpt / STS_FILE).read_text()) if (ckpt / STS_FILE).exists() else {}
        single = {k: tuple(v) if isinstance(v, list) else float(v) for k, v in raw.items()}
        return {"sts": single.get("sampling", 1.0), "greedy_sts": single.get("greedy")}
    return {"sts": sts.get("sampling", 1.0), "greedy_confidence": head, "greedy_sts": sts.get("greedy")}


def _latency(spec: str, model, batch: int, ema: float):
    from deepinfer_dspark import LatencyModel

    if spec == "profile":
        return profile_latency(model, batch, ema=ema)
    base, slope = (float(x) for x in spec.removeprefix("affine:").split(","))
    return LatencyModel.affine(base, slope, batch * 8, ema=ema)


def measure(ckpt: Path, *, batch: int = 16, prompt_len: int = 16, new_tokens: int = 48, seed: int = 1000,
            temperatures: tuple[float, ...] = (0.0, 1.0), thresholds: tuple[float, ...] = (0.5,),
            latency_specs: tuple[str, ...] = ("profile",), ema: float = 0.05, threads: int = 1,
            heads: str = "shipped", log: Callable[[str], None] = print) -> dict:
    """Per temperature: plain decoding, then verify_all, threshold and cost (once per latency spec): mean accepted
    length, verified draft tokens per step, tokens/s on this machine."""
    from deepinfer_dspark import LatencyModel, VerifyPolicy
    from deepinfer_engine.model.loader import load_model

    torch.set_num_threads(threads)
    model = load_model(ckpt, dtype=torch.float32)
    data = sequences(tokenize(corpus_sentences(seed, 400), ckpt / "tokenizer.json"), prompt_len)
    prompts = data[:batch]
    drafter_heads = shipped_heads(ckpt, heads)
    log(f"confidence heads ({heads}): " + json.dumps({k: v if not isinstance(v, Tensor) else "greedy head"
                                                      for k, v in drafter_heads.items()}))
    curves = {spec: _latency(spec, model, batch, ema) for spec in latency_specs}
    for spec, c in curves.items():
        log(f"latency {spec}: {dict(zip(c.sizes, [round(t * 1e3, 2) for t in c.seconds]))} ms")
    report: dict = {"settings": {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "seed": seed,
                                 "thresholds": thresholds, "ema": ema, "threads": threads, "heads": heads,
                                 "latency": {k: {"sizes": c.sizes, "ms": [round(t * 1e3, 3) for t in c.seconds]}
                                             for k, c in curves.items()}}, "runs": []}
    runs = [("verify_all", VerifyPolicy(kind="verify_all"), None, "")]
    runs += [(f"threshold[{t}]", VerifyPolicy(kind="threshold", threshold=t), None, "") for t in thresholds]
    runs += [(f"cost[{k}]", VerifyPolicy(kind="cost"), c, k) for k, c in curves.items()]
    for temp in temperatures:
        ref = generate(model, prompts, new_tokens, temperature=temp, seed=seed)
        report["runs"].append({"policy": "none", "temperature": temp, "steps": ref["steps"],
                               "tokens_per_s": ref["generated"] / ref["seconds"]})
        log(json.dumps(report["runs"][-1]))
        for name, pol, curve, spec in runs:
            lat = None if curve is None else LatencyModel(curve.sizes, curve.seconds, ema=ema)
            # only a measured curve is corrected with this machine's timings; an affine one models another device
            r = generate(model, prompts, new_tokens, policy=pol, latency=lat, temperature=temp, seed=seed,
                         online=spec == "profile", heads=drafter_heads)
            st = r["stats"]
            row = {"policy": name, "temperature": temp, "steps": r["steps"],
                   "mean_accepted_length": st.mean_accepted_length,
                   "verified_per_step": st.verified_tokens_per_step,
                   "verified_per_request_step": st.verified_tokens_per_request_step,
                   "num_draft_tokens": st.num_draft_tokens, "num_verified_tokens": st.num_verified_tokens,
                   "num_accepted_tokens": st.num_accepted_tokens,
                   "verification_efficiency": st.verification_efficiency,
                   "acceptance_by_position": st.conditional_acceptance_by_position(),
                   "confidence_error": st.confidence_error,
                   "tokens_per_s": r["generated"] / r["seconds"],
                   "matches_plain_greedy": bool(torch.equal(r["tokens"], ref["tokens"])) if temp == 0 else None}
            report["runs"].append(row)
            log(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                            if k != "acceptance_by_position"}))
    return report


def paired(ckpt: Path, *, prompts: int = 64, prompt_len: int = 16, new_tokens: int = 48,
           seeds: tuple[int, ...] = (1000, 2000), temperatures: tuple[float, ...] = (0.0, 1.0),
           thresholds: tuple[float, ...] = (0.1, 0.2), affine: tuple[str, ...] = (), heads: str = "shipped",
           threads: int = 1, log: Callable[[str], None] = print) -> dict:
    """Every policy decided on the SAME rounds (a paired comparison without trajectory noise): one verify_all run
    per (temperature, prompt set) records each round's survivals and accepted drafts A; a policy's choice m on that
    round then accepts min(A, m), because whether draft j is accepted never depends on how many drafts are
    verified (greedy: argmax agreement; sampling: counter-based uniforms keyed by position). The policies see the
    batch of each round as it was (cost: T(Q) = BASE + SLOPE * Q of the round's requests). What this does not
    model: runs with fewer accepted tokens take more rounds, so later batches differ."""
    from deepinfer_dspark import LatencyModel, VerifyPolicy, schedule_verification
    from deepinfer_engine.model.loader import load_model

    torch.set_num_threads(threads)
    model = load_model(ckpt, dtype=torch.float32)
    n = model.args.dspark_block_size
    drafter_heads = shipped_heads(ckpt, heads)
    policies = [("verify_all", VerifyPolicy(kind="verify_all"), None)]
    policies += [(f"threshold[{t}]", VerifyPolicy(kind="threshold", threshold=t), None) for t in thresholds]
    for spec in affine:
        base, slope = (float(x) for x in spec.split(","))
        policies.append((f"cost[{spec}]", VerifyPolicy(kind="cost"), LatencyModel.affine(base, slope, 8 * prompts)))
    rows = []
    for temp in temperatures:
        for seed in seeds:
            data = sequences(tokenize(corpus_sentences(seed, 30 * prompts), ckpt / "tokenizer.json"), prompt_len)
            rounds = []
            generate(model, data[:prompts], new_tokens, policy=policies[0][1], temperature=temp, seed=seed,
                     heads=drafter_heads, record=lambda b, prop, a, res, out=rounds: out.append(
                         (prop.survival(), res.num_accepted.clone())))
            steps = sum(int(s.shape[0]) for s, _ in rounds)
            for name, pol, lat in policies:
                verified = accepted = 0
                for surv, acc in rounds:
                    m = schedule_verification(pol, torch.full((surv.shape[0],), n), survival=surv, latency=lat,
                                              deterministic=temp == 0)
                    verified += int(m.sum())
                    accepted += int(torch.minimum(acc, m).sum())
                rows.append({"policy": name, "temperature": temp, "seed": seed, "request_steps": steps,
                             "mean_accepted_length": 1 + accepted / steps, "verified_per_request_step": verified / steps})
            base = rows[-len(policies)]
            for r in rows[-len(policies):]:
                r["tau_vs_verify_all"] = r["mean_accepted_length"] / base["mean_accepted_length"]
                r["verified_vs_verify_all"] = r["verified_per_request_step"] / base["verified_per_request_step"] - 1
                log(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()}))
    summary = []
    for temp in temperatures:
        for name, _, _ in policies:
            rs = [r for r in rows if r["temperature"] == temp and r["policy"] == name]
            t, v = [r["tau_vs_verify_all"] for r in rs], [r["verified_vs_verify_all"] for r in rs]
            summary.append({"temperature": temp, "policy": name, "tau_vs_verify_all": (sum(t) / len(t), min(t), max(t)),
                            "verified_vs_verify_all": (sum(v) / len(v), min(v), max(v)),
                            "tau": sum(r["mean_accepted_length"] for r in rs) / len(rs)})
            e = summary[-1]
            log(f"T={temp:g} {name:<22} tau {e['tau']:.2f}  tau vs all {e['tau_vs_verify_all'][0]:.3f} "
                f"({e['tau_vs_verify_all'][1]:.3f}..{e['tau_vs_verify_all'][2]:.3f})  verified vs all "
                f"{e['verified_vs_verify_all'][0] * 100:+.0f}% ({e['verified_vs_verify_all'][1] * 100:+.0f}.."
                f"{e['verified_vs_verify_all'][2] * 100:+.0f})")
    return {"settings": {"prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens, "seeds": seeds,
                         "heads": heads, "threads": threads}, "rows": rows, "summary": summary}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="train the testbed and write its checkpoint")
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--threads", type=int, default=1)
    b.add_argument("--force", action="store_true", help="rebuild even if testbed.json records the same settings")
    for k, v in BUILD_DEFAULTS.items():
        b.add_argument("--" + k.replace("_", "-"), type=type(v), default=v)
    m = sub.add_parser("measure", help="speculative decoding per policy on a built checkpoint")
    m.add_argument("--ckpt", type=Path, required=True)
    m.add_argument("--batch", type=int, default=16)
    m.add_argument("--prompt-len", type=int, default=16)
    m.add_argument("--new-tokens", type=int, default=48)
    m.add_argument("--threshold", type=float, action="append", default=None, help="repeatable; default 0.5")
    m.add_argument("--latency", action="append", default=None,
                   help="'profile' (time the target forward at start-up) or 'affine:BASE,SLOPE' (seconds, seconds per "
                        "query token); repeat for several cost-policy runs")
    m.add_argument("--ema", type=float, default=0.05)
    m.add_argument("--threads", type=int, default=1)
    m.add_argument("--heads", choices=("shipped", "checkpoint", "raw"), default="shipped",
                   help="Confidence Head calibration: the shipped greedy head + STS (default), the checkpoint's head "
                        "with its STS sets, or the raw checkpoint head")
    m.add_argument("--temperature", type=float, action="append", default=None, help="repeatable; default 0 and 1")
    m.add_argument("--json", type=Path, default=None)
    q = sub.add_parser("paired", help="every policy decided on the rounds of one verify_all run (paired frontier)")
    q.add_argument("--ckpt", type=Path, required=True)
    q.add_argument("--prompts", type=int, default=64)
    q.add_argument("--new-tokens", type=int, default=48)
    q.add_argument("--seeds", type=int, nargs="+", default=[1000, 2000])
    q.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0])
    q.add_argument("--threshold", type=float, nargs="+", default=[0.1, 0.2])
    q.add_argument("--affine", nargs="*", default=[], metavar="BASE,SLOPE")
    q.add_argument("--heads", choices=("shipped", "checkpoint", "raw"), default="shipped")
    q.add_argument("--threads", type=int, default=1)
    q.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.cmd == "paired":
        rep = paired(args.ckpt, prompts=args.prompts, new_tokens=args.new_tokens, seeds=tuple(args.seeds),
                     temperatures=tuple(args.temperature), thresholds=tuple(args.threshold), affine=tuple(args.affine),
                     heads=args.heads, threads=args.threads)
        if args.json:
            args.json.write_text(json.dumps(rep, indent=2) + "\n")
    if args.cmd == "measure":
        rep = measure(args.ckpt, batch=args.batch, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                      thresholds=tuple(args.threshold or [0.5]), latency_specs=tuple(args.latency or ["profile"]), ema=args.ema, threads=args.threads,
                      heads=args.heads, temperatures=tuple(args.temperature or [0.0, 1.0]))
        if args.json:
            args.json.write_text(json.dumps(rep, indent=2) + "\n")
    if args.cmd == "build":
        kw = {k: getattr(args, k) for k in BUILD_DEFAULTS}
        print(json.dumps(build(args.out, threads=args.threads, force=args.force, **kw), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
