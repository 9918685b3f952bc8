"""prefill_flops against the matrix-product FLOPs torch counts on the tiny V4.1 model (torch.utils.flop_counter),
with and without decoder truncation, and its arithmetic on the real V4.1 config."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from deepinfer_engine.errors import ConfigError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.engram_hash import synthetic_token_map
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_config, tiny_v41_config
from deepinfer_engine.prefill_flops import _visible_sum, prefill_flops
from equality import init_random_
from torch.utils.flop_counter import FlopCounterMode

REAL = Path(__file__).parent / "data" / "v41_flash_config.json"


@pytest.fixture(scope="module")
def tiny() -> Transformer:
    args = ModelArgs.from_config_dict(tiny_v41_config())
    m = Transformer(args, torch.float32, with_draft=False)
    init_random_(m, seed=1)
    m.set_engram_token_map(synthetic_token_map(args.vocab_size, args.engram_compressed_vocab_size))
    return m.eval()


@pytest.mark.parametrize(("prompt_len", "keep"), [(40, None), (40, 22), (9, 22), (64, 30)])
def test_formula_equals_counted_flops(tiny: Transformer, prompt_len: int, keep: int | None) -> None:
    """Exact: the torch references score every entry for every query (causal=False)."""
    tiny.set_prefill_truncation("off" if keep is None else "compact", keep or 140)
    try:
        cache, bt = ModelCache.allocate_dense(tiny.args, [prompt_len], dtype=torch.float32)
        ids = torch.randint(3, 500, (prompt_len,), generator=torch.Generator().manual_seed(prompt_len))
        batch = ForwardBatch.single(ids, block_table=bt[0], all_logits=False)
        with FlopCounterMode(display=False) as counter:
            tiny(dataclasses.replace(batch, known_lens=(prompt_len,)), cache)
    finally:
        tiny.set_prefill_truncation("off")
    assert counter.get_total_flops() == prefill_flops(tiny.args, prompt_len, keep, causal=False).total


def test_visible_sum_is_the_causal_count() -> None:
    for ratio in (1, 2):
        for first in (0, 3, 8):
            for rows in (1, 5, 16):
                assert _visible_sum(first, rows, ratio) == sum((t + 1) // ratio for t in range(first, first + rows))


def test_real_config_truncation_saves_the_decoder_half() -> None:
    a = ModelArgs.from_file(REAL)
    assert prefill_flops(a, 140, 140) == prefill_flops(a, 140)  # nothing to drop
    for P in (1024, 131072):
        full, cut = prefill_flops(a, P), prefill_flops(a, P, 140)
        assert cut.total - cut.decoder == full.total - full.decoder  # encoder layers and head: untouched
        assert cut.decoder < full.decoder / 7  # the decoder runs 140 rows (+ the boundary's all-row compressor)
        assert prefill_flops(a, P, causal=True).index < prefill_flops(a, P, causal=False).index
    # about 34 GFLOP per token without truncation: ~17 B parameters active per token (2 FLOP each)
    assert 30e9 < prefill_flops(a, 1024).total / 1024 < 40e9


def test_v4_is_refused() -> None:
    with pytest.raises(ConfigError, match="arch 'v4'"):
        prefill_flops(ModelArgs.from_config_dict(tiny_v4_config()), 16)
