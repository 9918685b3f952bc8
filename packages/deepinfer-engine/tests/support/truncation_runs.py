"""Test harness of prefill truncation (used by tests/model/test_truncation.py and
scripts/prefill_truncation_error.py): chunked prefill + greedy decode under a truncation mode, and the tiny-width
model with the real V4.1 layer topology.
"""

from __future__ import annotations

import dataclasses

import torch
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.engram_hash import engram_num_embeddings, synthetic_token_map
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v41_config
from equality import init_random_

__all__ = ["STEPS", "generate", "prompt", "real_topology_model", "real_topology_tiny_config", "step_batch"]

STEPS = 5  # greedy tokens after the prompt


def prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed))


def step_batch(ids: torch.Tensor, start: int, bt: torch.Tensor, known: int, *, last_logits: bool) -> ForwardBatch:
    b = ForwardBatch.single(ids.to(bt.device), start_pos=start, block_table=bt, all_logits=False)
    li = b.logits_indices if last_logits else torch.zeros(0, dtype=torch.int64, device=bt.device)
    return dataclasses.replace(b, logits_indices=li, known_lens=(known,))


@torch.no_grad()
def generate(m: Transformer, ids: torch.Tensor, chunks: list[int], mode: str, keep: int = 140,
             steps: int = STEPS) -> tuple[torch.Tensor, list[int], torch.Tensor]:
    """Chunked prefill (logits only at the end), then greedy decode, on the model's device. Returns (first-token
    logits [V], greedy tokens, the decode steps' logits [steps, V])."""
    m.set_prefill_truncation(mode, keep)
    n = ids.numel()
    device = next(m.parameters()).device
    cache, bt = ModelCache.allocate_dense(m.args, [n + steps + 8], dtype=torch.float32, device=device)
    s = 0
    for c in chunks:
        out = m(step_batch(ids[s : s + c], s, bt[0], n, last_logits=s + c == n), cache)
        s += c
    first = out[-1]
    tok, toks, dec = int(first.argmax()), [], []
    for i in range(steps):
        toks.append(tok)
        logits = m(step_batch(torch.tensor([tok]), n + i, bt[0], n + i + 1, last_logits=True), cache)[-1]
        dec.append(logits)
        tok = int(logits.argmax())
    m.set_prefill_truncation("off")
    return first, toks, torch.stack(dec) if dec else first[:0]


def real_topology_tiny_config() -> dict:
    """tiny_v41_config widths with the real V4.1 layer topology: 40 layers [0,0]+[2]*18+[1]*20, window 128, kv
    sources 2/8/14/20, index sources 2/8/.../36, candidate publisher 20, DSpark targets 37-39."""
    cfg = tiny_v41_config()
    tc = cfg["text_config"]
    tc.update(
        num_hidden_layers=40, sliding_window=128, compress_ratios=[0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        kv_source_layer_ids=[2, 8, 14, 20], index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36],
        candidate_source_layer_id=20, engram_layer_ids=[1, 14], dspark_target_layer_ids=[37, 38, 39],
    )  # fmt: skip
    tc["engram_num_embeddings"] = engram_num_embeddings(
        tc["engram_layer_ids"], tc["engram_max_ngram_size"], tc["engram_n_heads"], tc["engram_vocab_size"]
    )
    return cfg


def real_topology_model(seed: int = 5) -> Transformer:
    """fp32, random weights from `seed`, no draft stages, the synthetic Engram token map, eval mode."""
    args = ModelArgs.from_config_dict(real_topology_tiny_config())
    m = Transformer(args, torch.float32, with_draft=False)
    init_random_(m, seed=seed)
    m.set_engram_token_map(synthetic_token_map(args.vocab_size, args.engram_compressed_vocab_size))
    return m.eval()
