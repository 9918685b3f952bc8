"""Test scenario of the DSpark draft-context insertion through its fixed-shape / graph path against the eager one
(`SpecDecoder.insert_context` with and without `insert_runner`), shared by the CPU test (the runner's "graphs"
replayed eagerly: eager_graphs.EagerReplayGraphs) and the GPU test (real CUDA graphs).

Four sequences (contexts below, at and past the stage window) run four speculative rounds: one target forward
over every chunk (verify chunks of N + 1 rows and shorter, a plain one-token chunk), then the insertion of each
chunk's kept rows into two copies of the draft rings, once eagerly and once through the runner. The kept counts
cover no accepted draft (1 row), every draft accepted (N + 1 rows), partial acceptance and a request keeping
nothing (a dropped round), so the runner sees buckets with padding rows and padding sequences. After each round:
the two ring copies agree on every row of every request slot (the kept positions' rows and, since padding rows
go to the scratch slot, all others too), and the next draft pass of every sequence over either copy gives the
same base logits, hidden rows and greedy drafts."""

from __future__ import annotations

import torch
from deepinfer_dspark import VerifyPolicy
from deepinfer_engine.core.sched_output import ScheduledChunk
from deepinfer_engine.model import dspark
from deepinfer_engine.model.cache import ModelCache
from deepinfer_engine.model.dspark_drafter import StageDrafter
from deepinfer_engine.model.forward_batch import ForwardBatch
from deepinfer_engine.worker.spec_decode import SpecDecoder
from equality import max_rel_err

__all__ = ["insert_cache", "insert_rounds"]


def _rounds(N: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(chunk rows, kept rows) per round and sequence; N + 1 = a chunk verifying every draft."""
    A = N + 1
    return [
        ((A, A, 4, A), (1, A, 3, 0)),  # none accepted, all accepted, partial, nothing kept: 3 sequences in 4
        ((A, 1, 2, A), (A, 1, 1, 4)),  # a plain one-token chunk among verify chunks; every sequence keeps rows
        ((3, A, A, 5), (0, 0, A, 0)),  # one sequence: bucket 1
        ((A, A, 1, A), (2, 1, 1, A)),
    ]


def _spec(model, cache: ModelCache, bt: torch.Tensor, runner) -> SpecDecoder:
    a = model.args
    spec = SpecDecoder(StageDrafter(model, cache, bt), policy=VerifyPolicy(kind="verify_all"), latency=None,
                       capture=tuple(a.dspark_target_layer_ids), max_position=int(a.max_position_embeddings))
    spec.insert_runner = runner
    return spec


def _chunk(i: int, ids: list[int], start: int, n: int) -> ScheduledChunk:
    return ScheduledChunk(req_id=f"r{i}", token_ids=tuple(ids), start_position=start, slot=i, new_page_ids=(),
                          sample=True, output_index=0, num_prompt_tokens=0, num_spec_tokens=n)


def insert_rounds(model, graphs, bt: torch.Tensor, device: torch.device, *, tol: float, seed: int = 0) -> list[dict]:
    """Run the scenario (module docstring) with `graphs` (a CudaGraphRunner over `graphs.cache`, made for at most
    4 sequences; `insert_cache` makes the cache and its block tables bt) as the runner; asserts as it goes
    (relative tolerance `tol`: max|Δ| / max|ref|). Returns per round {"keep", "drafts"}."""
    a = model.args
    N, W = int(a.dspark_block_size), int(a.sliding_window)
    tids = tuple(a.dspark_target_layer_ids)
    cache = graphs.cache
    prompts = [3, W, W + 7, 2 * W + 3]
    rounds = _rounds(N)
    eager_spec = _spec(model, cache, bt, None)
    graph_spec = _spec(model, cache, bt, graphs.run_insert)
    lids = [st.attn.layer_id for st in dspark.draft_stages(model)]
    slots = len(prompts)
    gen = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(3, a.vocab_size, (n,), generator=gen).tolist()

    def snapshot() -> dict[int, torch.Tensor]:
        return {lid: cache.swa[lid].clone() for lid in lids}

    def load(rings: dict[int, torch.Tensor]) -> None:
        for lid in lids:
            cache.swa[lid].copy_(rings[lid])

    def forward(chunks: list[ScheduledChunk]) -> dict[int, torch.Tensor]:
        ids = torch.tensor([t for c in chunks for t in c.token_ids], device=device)
        pos = torch.tensor([c.start_position + j for c in chunks for j in range(c.num_tokens)], device=device)
        sl = torch.tensor([c.slot for c in chunks], device=device)
        batch = ForwardBatch(input_ids=ids, positions=pos, query_lens=tuple(c.num_tokens for c in chunks),
                             slots=tuple(c.slot for c in chunks), block_tables=bt[sl],
                             logits_indices=torch.arange(ids.numel(), device=device))  # fmt: skip
        return model.forward_features(batch, cache, capture=tids).features

    # prompts: the target's prefill and the draft context of every prompt position (eager, one copy for both)
    ctx = [0] * slots
    for i, n in enumerate(prompts):
        c = _chunk(i, rand(n), 0, 0)
        eager_spec.insert_context([c], {c.req_id: n}, forward([c]))
        ctx[i] = n
    eager, static = snapshot(), snapshot()
    out = []
    for rows, keep in rounds:
        chunks = [_chunk(i, rand(n), ctx[i], N) for i, n in enumerate(rows)]
        feats = forward(chunks)
        kept = {c.req_id: k for c, k in zip(chunks, keep)}
        before = graphs.stats.insert_replays
        load(eager)
        eager_spec.insert_context(chunks, kept, feats)
        eager = snapshot()
        load(static)
        graph_spec.insert_context(chunks, kept, feats)
        static = snapshot()
        assert graphs.stats.insert_replays == before + 1, graphs.stats  # the runner took the round
        for lid in lids:
            R = cache.window_rows(lid)
            for i, k in enumerate(keep):  # every kept position's row ...
                for p in range(ctx[i], ctx[i] + k):
                    got, ref = static[lid][i, p % R], eager[lid][i, p % R]
                    assert max_rel_err(got, ref) <= tol, (lid, i, p)
            # ... and every other row of the request slots: nothing past a sequence's kept rows was written
            assert max_rel_err(static[lid][:slots], eager[lid][:slots]) <= tol, lid
        ctx = [c + k for c, k in zip(ctx, keep)]
        # the next round's draft pass over either copy: the same blocks, the same greedy drafts
        anchors = torch.tensor(rand(slots), device=device)
        ids = dspark.draft_block_ids(anchors, N, a.dspark_noise_token_id)
        pos = torch.cat([torch.arange(c, c + N, device=device) for c in ctx])
        batch = ForwardBatch(input_ids=ids, positions=pos, query_lens=(N,) * slots, slots=tuple(range(slots)),
                             block_tables=bt[:slots], logits_indices=torch.zeros(1, dtype=torch.int64, device=device))
        blocks = []
        for rings in (eager, static):
            load(rings)
            blk = dspark.draft_block(model, batch, cache)
            blocks.append((blk, dspark.greedy_draft(model, blk, anchors)[0]))
        (ref, ref_ids), (got, got_ids) = blocks
        assert max_rel_err(got.base_logits, ref.base_logits) <= tol and max_rel_err(got.hidden, ref.hidden) <= tol
        assert torch.equal(got_ids, ref_ids), (got_ids, ref_ids)
        load(eager)
        out.append({"keep": keep, "drafts": ref_ids})
    return out


def insert_cache(model, device: torch.device) -> tuple[ModelCache, torch.Tensor]:
    """A cache for the scenario's 4 sequences (and its block tables on `device`)."""
    a = model.args
    N, W = int(a.dspark_block_size), int(a.sliding_window)
    need = 2 * W + 3 + 4 * (N + 1) + N + 8
    return ModelCache.allocate_dense(a, [need] * 4, dtype=torch.float32, device=device)
