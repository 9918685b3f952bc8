"""The runner's persistent input batch: block tables rebuilt from the scheduler's page diffs, step tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from deepinfer_engine.core.sched_output import NewRequestData, ScheduledChunk, SchedulerOutput
from deepinfer_engine.errors import InputError
from deepinfer_engine.worker.input_batch import InputBatch


def _chunk(rid, ids, start, slot, pages, sample=True):
    return ScheduledChunk(req_id=rid, token_ids=tuple(ids), start_position=start, slot=slot,
                          new_page_ids=tuple(pages), sample=sample, output_index=0, num_prompt_tokens=len(ids))


def _new(rid):
    return NewRequestData(req_id=rid, prompt_token_ids=(1, 2), output_token_ids=[], sampling=None, seed=0)


def test_tables_follow_the_diffs_and_the_step_tensors_match_the_chunks():
    ib = InputBatch("cpu", max_num_tokens=2, max_table=2)  # tiny buffers: every step below has to grow them
    s1 = SchedulerOutput(chunks=(_chunk("a", [5, 6, 7], 0, 1, [4, 2]), _chunk("b", [9], 0, 0, [7])),
                         new_requests=(_new("a"), _new("b")))
    ib.update(s1)
    inp = ib.prepare(s1.chunks, [2, 3])
    assert inp.input_ids.tolist() == [5, 6, 7, 9] and inp.positions.tolist() == [0, 1, 2, 0]
    assert inp.logits_indices.tolist() == [2, 3]
    assert inp.block_tables.tolist() == [[4, 2], [7, -1]]
    assert inp.seq_of_token.tolist() == [0, 0, 0, 1]
    assert inp.seq.ctx.tolist() == [0, 0] and inp.seq.start.tolist() == [0, 3] and inp.seq.slot.tolist() == [1, 0]
    assert inp.host.ctx_lens == (0, 0) and inp.host.input_ids.tolist() == [5, 6, 7, 9]
    np.testing.assert_array_equal(inp.host.block_tables, [[4, 2], [7, -1]])
    # decode step: b gets a new page only; a is preempted (its table dropped), c arrives
    s2 = SchedulerOutput(chunks=(_chunk("b", [3], 1, 0, [8]), _chunk("c", [1, 1], 0, 1, [4])),
                         new_requests=(_new("c"),), preempted_req_ids=frozenset({"a"}))
    ib.update(s2)
    inp = ib.prepare(s2.chunks, [0, 2])
    assert ib.block_table("b") == (7, 8) and ib.block_table("c") == (4,) and ib.num_requests == 2
    assert inp.positions.tolist() == [1, 0, 1] and inp.block_tables.tolist() == [[7, 8], [4, -1]]
    # a resumed request is sent as new again: its table restarts from the resent pages
    s3 = SchedulerOutput(chunks=(_chunk("a", [5], 0, 0, [1, 3]),), new_requests=(_new("a"),),
                         finished_req_ids=frozenset({"b", "c"}))
    ib.update(s3)
    assert ib.block_table("a") == (1, 3) and ib.num_requests == 1


def test_a_chunk_of_an_unknown_request_is_a_typed_error():
    ib = InputBatch("cpu")
    with pytest.raises(InputError, match="never sent"):
        ib.update(SchedulerOutput(chunks=(_chunk("x", [1], 0, 0, [0]),)))


def test_step_tensors_feed_the_model_batch():
    from deepinfer_engine.model.forward_batch import ForwardBatch

    ib = InputBatch("cpu")
    s = SchedulerOutput(chunks=(_chunk("a", [5, 6], 3, 0, [0]),), new_requests=(_new("a"),))
    ib.update(s)
    inp = ib.prepare(s.chunks, [1])
    batch = ForwardBatch(input_ids=inp.input_ids, positions=inp.positions, query_lens=inp.query_lens,
                         slots=inp.slots, block_tables=inp.block_tables, logits_indices=inp.logits_indices,
                         host=inp.host, seq=inp.seq, seq_of_token=inp.seq_of_token)
    assert batch.positions.tolist() == [3, 4] and batch.host.ctx_lens == (3,)
    assert batch.input_ids.dtype == torch.int64 and batch.block_tables.dtype == torch.int32
