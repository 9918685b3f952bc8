"""The step contracts: `ScheduledChunk.with_token_ids` is `dataclasses.replace` of the ids (every other field kept)."""

from __future__ import annotations

import dataclasses

from deepinfer_engine.core.sched_output import ScheduledChunk


def test_with_token_ids_keeps_every_other_field() -> None:
    # a value of each field that differs from any default, so a field the method forgets shows
    values = {"req_id": "r", "token_ids": (7,), "start_position": 11, "slot": 3, "new_page_ids": (4, 5), "sample": True,
              "output_index": 2, "num_prompt_tokens": 9, "num_spec_tokens": 6}
    assert set(values) == {f.name for f in dataclasses.fields(ScheduledChunk)}
    chunk = ScheduledChunk(**values)
    got = chunk.with_token_ids((7, 1, 2))
    assert got == dataclasses.replace(chunk, token_ids=(7, 1, 2)) and got.num_tokens == 3
    assert chunk.token_ids == (7,)
