"""Prefill truncation, compact mode (docs/prefill_truncation.md), on tiny V4.1 models in fp32 on CPU.

Exact regime: with KEEP at the exactness bound the first-token logits and the greedy continuation equal a full
prefill (tolerance 1e-5 relative, as the other V4.1 equalities), for one chunk, chunks that split the kept
rectangle, and a batch mixing truncated, untouched, fully dropped and all-rows (prompt logprobs) sequences. One
row less than the bound must differ (the bound is tight). Approximate regime: the real layer topology (40 layers,
window 128, 20 decoder layers) at tiny widths with the default KEEP 140, where the divergence is measured.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from deepinfer_engine.errors import ConfigError, InputError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.model.model import Transformer
from deepinfer_engine.model.presets import tiny_v4_config
from deepinfer_engine.model.truncation import decoder_split, exact_keep
from equality import max_rel_err
from truncation_runs import generate, prompt, real_topology_model, step_batch

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = 1e-5


@pytest.fixture(scope="module")
def model(make_tiny_v41_model) -> Transformer:
    return make_tiny_v41_model(seed=11)


def test_split_of_the_real_and_tiny_configs(model: Transformer) -> None:
    real = decoder_split(ModelArgs.from_file(Path(__file__).parents[1] / "data" / "v41_flash_config.json"), 140)
    assert (real.boundary, real.num_decoder_layers, real.window, real.exact) == (20, 20, 128, False)
    assert real.borrowed_topk == () and real.borrowed_candidates == ()
    s = decoder_split(model.args, 22)
    assert (s.boundary, s.num_decoder_layers, s.window, s.exact) == (5, 3, 8, True)
    assert exact_keep(8, 3) == 22 == 3 * (8 - 1) + 1


@pytest.mark.parametrize("chunks", [[70], [30, 40], [50, 20], [20, 20, 30]])
def test_exact_keep_equals_full_prefill(model: Transformer, chunks: list[int]) -> None:
    """[50, 20] and [20, 20, 30] split the kept rectangle (positions 48..69) across chunks."""
    ids = prompt(70, 3)
    ref, ref_toks, ref_dec = generate(model, ids, [70], "off")
    keep = exact_keep(model.args.sliding_window, 3)
    first, toks, dec = generate(model, ids, chunks, "compact", keep)
    err = max(max_rel_err(first, ref), max_rel_err(dec, ref_dec))
    print(f"compact keep {keep} chunks {chunks}: max rel err {err:.3g}")
    assert err <= TOL and toks == ref_toks


def test_exact_keep_with_deployed_kv_numerics(model: Transformer) -> None:
    """kv_cache_dtype="auto" numerics (FP8 window records, FP4 compressed KV and index keys): still exact."""
    ids = prompt(70, 3)
    model.set_deployed_numerics(True)
    try:
        ref, ref_toks, ref_dec = generate(model, ids, [70], "off")
        first, toks, dec = generate(model, ids, [50, 20], "compact", exact_keep(model.args.sliding_window, 3))
    finally:
        model.set_deployed_numerics(False)
    assert max(max_rel_err(first, ref), max_rel_err(dec, ref_dec)) <= TOL and toks == ref_toks


@pytest.mark.gpu
def test_exact_keep_on_cuda(make_tiny_v41_model) -> None:
    """The same equality on CUDA (the device's kernels in both modes; fp32)."""
    m = make_tiny_v41_model(seed=11).to("cuda")
    ids = prompt(70, 3)
    old = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32: fp32 differences only
    try:
        ref, ref_toks, ref_dec = generate(m, ids, [70], "off")
        for chunks in ([70], [50, 20]):
            first, toks, dec = generate(m, ids, chunks, "compact", exact_keep(m.args.sliding_window, 3))
            assert first.is_cuda and max(max_rel_err(first, ref), max_rel_err(dec, ref_dec)) <= 1e-4, chunks
            assert toks == ref_toks, chunks
    finally:
        torch.set_float32_matmul_precision(old)


def test_one_row_below_the_bound_differs(model: Transformer) -> None:
    ids = prompt(70, 3)
    ref, _, _ = generate(model, ids, [70], "off", steps=0)
    first, _, _ = generate(model, ids, [70], "compact", exact_keep(model.args.sliding_window, 3) - 1, steps=0)
    assert max_rel_err(first, ref) > 2 * TOL  # measured 4.4e-5: one clipped window row reaches the last row


def test_truncated_rows_never_reach_the_decoder_rings(model: Transformer) -> None:
    """Decoder ring rows of dropped positions are never written nor read: rings pre-filled with NaN stay NaN at
    those positions, and the output is still exact (the window floor masks them)."""
    ids = prompt(70, 3)
    keep = exact_keep(model.args.sliding_window, 3)
    ref, _, _ = generate(model, ids, [70], "off", steps=0)
    model.set_prefill_truncation("compact", keep)
    cache, bt = ModelCache.allocate_dense(model.args, [80], dtype=torch.float32)
    for ring in cache.swa.values():
        ring.fill_(float("nan"))
    seen: list[int] = []
    hook = model.layers[6].register_forward_pre_hook(lambda mod, inp: seen.append(inp[0].shape[0]))
    decoder = [lid for lid in cache.swa if 5 <= lid < 8]
    try:
        with torch.no_grad():
            # the rectangle 48..69 lies in the second chunk only: the first writes no decoder ring row
            model(step_batch(ids[:40], 0, bt[0], 70, last_logits=False), cache)
            assert all(torch.isnan(cache.swa[lid][0]).all() for lid in decoder)
            assert not torch.isnan(cache.swa[4][0]).any()  # encoder rings: written as always
            out = model(step_batch(ids[40:], 40, bt[0], 70, last_logits=True), cache)
    finally:
        hook.remove()
        model.set_prefill_truncation("off")
    assert seen == [keep]  # the first chunk ran no decoder row, the second its last `keep` rows
    # exact although every decoder ring row below the rectangle is NaN: the window floor never reads one
    assert max_rel_err(out[-1], ref) <= TOL
    assert all(not torch.isnan(cache.swa[lid][0]).any() for lid in decoder)  # ring rows = the last kept rows


@torch.no_grad()
def test_batched_requests_keep_their_own_rows(model: Transformer) -> None:
    """One step mixing: A final chunk of a truncated prompt; B an early chunk with no kept row; C a short prompt
    (nothing dropped); D a long prompt with known_len 0 (prompt logprobs: every row, every logit)."""
    keep = exact_keep(model.args.sliding_window, 3)
    lens = [60, 90, 12, 50]
    seqs = [prompt(n, 10 + i) for i, n in enumerate(lens)]
    refs = []
    for s in seqs:
        cache, bt = ModelCache.allocate_dense(model.args, [s.numel()], dtype=torch.float32)
        refs.append(model(ForwardBatch.single(s, block_table=bt[0]), cache))
    model.set_prefill_truncation("compact", keep)
    try:
        cache, bt = ModelCache.allocate_dense(model.args, lens, dtype=torch.float32)
        # step 1: A's first 25 rows (all dropped), B's first 30 (all dropped)
        b1 = ForwardBatch(
            input_ids=torch.cat([seqs[0][:25], seqs[1][:30]]), positions=torch.cat([torch.arange(25), torch.arange(30)]),
            query_lens=(25, 30), slots=(0, 1), block_tables=bt[[0, 1]],
            logits_indices=torch.zeros(0, dtype=torch.int64), known_lens=(60, 90),
        )  # fmt: skip
        assert model(b1, cache).shape == (0, model.args.vocab_size)
        # step 2: A's rest (final), B's next 40 (still before its rectangle 68..89), C whole, D whole
        parts = [seqs[0][25:], seqs[1][30:70], seqs[2], seqs[3]]
        qlens = tuple(int(p.numel()) for p in parts)
        starts = (25, 30, 0, 0)
        ends = [sum(qlens[: i + 1]) for i in range(4)]
        li = torch.tensor([ends[0] - 1, ends[2] - 1] + list(range(ends[2], ends[3])))
        b2 = ForwardBatch(
            input_ids=torch.cat(parts), positions=torch.cat([torch.arange(s, s + q) for s, q in zip(starts, qlens)]),
            query_lens=qlens, slots=(0, 1, 2, 3), block_tables=bt, logits_indices=li, known_lens=(60, 90, 12, 0),
        )  # fmt: skip
        out = model(b2, cache)
        # step 3: B's final chunk
        b3 = step_batch(seqs[1][70:], 70, bt[1], 90, last_logits=True)
        b3 = dataclasses.replace(b3, slots=(1,))
        out_b = model(b3, cache)
    finally:
        model.set_prefill_truncation("off")
    assert max_rel_err(out[0], refs[0][-1]) <= TOL
    assert max_rel_err(out[1], refs[2][-1]) <= TOL
    assert max_rel_err(out[2:], refs[3]) <= TOL
    assert max_rel_err(out_b[-1], refs[1][-1]) <= TOL


def test_a_dropped_logits_row_is_an_input_error(model: Transformer) -> None:
    model.set_prefill_truncation("compact", 22)
    try:
        cache, bt = ModelCache.allocate_dense(model.args, [60], dtype=torch.float32)
        b = dataclasses.replace(ForwardBatch.single(prompt(60, 1), block_table=bt[0]), known_lens=(60,))
        with pytest.raises(InputError, match="prefill truncation drops"):
            model(b, cache)
    finally:
        model.set_prefill_truncation("off")


def test_bad_options_are_config_errors(model: Transformer) -> None:
    with pytest.raises(ConfigError, match=r"prefill_truncation_keep: found 13, expected .* >= .* = 14"):
        model.set_prefill_truncation("compact", 13)
    with pytest.raises(ConfigError, match="prefill_truncation: found 'mask'"):
        model.set_prefill_truncation("mask", 140)
    v4 = ModelArgs.from_config_dict(tiny_v4_config())
    with pytest.raises(ConfigError, match=r"arch 'v4'.*Fix: prefill_truncation='off'"):
        decoder_split(v4, 140)
    assert model.decoder_split is None


# ------------------------------------------------------------------ the real topology at tiny widths
@pytest.fixture(scope="module")
def real_topology() -> Transformer:
    return real_topology_model(seed=5)


@pytest.mark.slow  # ~8 s on 2 busy cores: 40 layers, 300-token prompts
def test_default_keep_on_the_real_topology_is_an_approximation(real_topology: Transformer) -> None:
    """KEEP 140 < exact bound 20 x 127 + 1 = 2541: measured, not equal (scripts/prefill_truncation_error.py gives
    the numbers of docs/prefill_truncation.md §3). Prompt 300 tokens in chunks 180 + 120, 2 prompts."""
    s = decoder_split(real_topology.args, 140)
    assert (s.boundary, s.num_decoder_layers, s.exact) == (20, 20, False)
    assert exact_keep(128, 20) == 2541
    errs = []
    for seed in range(2):
        ids = prompt(300, 100 + seed)
        ref, _, _ = generate(real_topology, ids, [300], "off", steps=0)
        first, _, _ = generate(real_topology, ids, [180, 120], "compact", 140, steps=0)
        errs.append(max_rel_err(first, ref))
    print(f"real topology, KEEP 140, prompt 300: first-token logit rel err {[f'{e:.3g}' for e in errs]}")
    assert min(errs) > 1e-3  # an approximation, measurably (fp32 rounding is ~1e-6)


@torch.no_grad()
def test_kept_rows_give_the_dspark_context(model: Transformer) -> None:
    """The target features of the kept rows (ModelOutput.kept_batch) fill the draft rings as a full prefill's
    features do: the draft block after the prompt gets the same base logits (tiny targets 5-7 are decoder layers)."""
    from deepinfer_engine.model.dspark import draft_block, draft_block_ids, insert_context, target_features

    a = model.args
    ids, n = prompt(70, 3), 70
    targets = tuple(a.dspark_target_layer_ids)
    drafts = []
    for mode in ("off", "compact"):
        model.set_prefill_truncation(mode, exact_keep(a.sliding_window, 3))
        try:
            cache, bt = ModelCache.allocate_dense(a, [n + a.dspark_block_size + 8], dtype=torch.float32)
            for s, c in ((0, 40), (40, 30)):
                batch = step_batch(ids[s : s + c], s, bt[0], n, last_logits=s + c == n)
                out = model.forward_features(batch, cache, capture=targets)
                rows = out.kept_batch if out.kept_batch is not None else batch
                if mode == "compact":
                    assert rows.num_tokens == (0 if s == 0 else 22) and out.features[5].shape[0] == rows.num_tokens
                if rows.num_tokens:
                    insert_context(model, rows, cache, target_features(out.features, targets))
            block = draft_block_ids(torch.tensor([7]), a.dspark_block_size, a.dspark_noise_token_id)
            drafts.append(draft_block(model, ForwardBatch.single(block, start_pos=n, block_table=bt[0]), cache))
        finally:
            model.set_prefill_truncation("off")
    assert max_rel_err(drafts[1].base_logits, drafts[0].base_logits) <= TOL
