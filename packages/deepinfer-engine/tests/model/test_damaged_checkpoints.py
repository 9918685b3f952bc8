"""Every case of the damaged-checkpoint corpus (tests/conftest.py) against the loader: damage the loader must
refuse raises the typed error naming the file and field at the stage that reads it; value damage (NaN / Inf /
invalid codes) loads, which is why `inspect --verify` exists (tests/commands/test_inspect_verify.py)."""

from __future__ import annotations

import pytest
from deepinfer_engine.errors import DeepInferError
from deepinfer_engine.model.args import ModelArgs
from deepinfer_engine.model.checkpoint import CheckpointReader
from deepinfer_engine.model.checkpoint_files import load_tokenizer, read_eos_ids


def _stages(d):
    def reader():
        CheckpointReader(d).close()

    def check():
        with CheckpointReader(d) as r:
            r.check()

    return {
        "args": lambda: ModelArgs.from_checkpoint_dir(d),
        "reader": reader,
        "check": check,
        "eos": lambda: read_eos_ids(d, ModelArgs.from_checkpoint_dir(d)),
        "tokenizer": lambda: load_tokenizer(d, required=False),
    }


def test_damage_is_caught_by_its_loading_stage(damaged_checkpoint, error_case, damage) -> None:
    d = damaged_checkpoint(error_case)
    stages = _stages(d)
    error_type, pattern, stage = damage.error
    with pytest.raises(error_type, match=pattern) as info:
        stages[stage]()
    assert isinstance(info.value, DeepInferError)
    # the stages before it accept the checkpoint: the error comes from the file that is damaged
    order = ["args", "reader", "check", "eos", "tokenizer"]
    for earlier in order[: order.index(stage)]:
        if stage in ("eos", "tokenizer") and earlier in ("reader", "check"):
            continue  # small files do not depend on the weights
        stages[earlier]()


@pytest.mark.parametrize(("value_case", "tensor"), [("nan_norm_weight", "norm.weight"),
                                                   ("e8m0_nan_scale", "layers.0.ffn.experts.0.w1.weight")])
def test_value_damage_loads_silently(damaged_checkpoint, value_case: str, tensor: str) -> None:
    d = damaged_checkpoint(value_case)
    with CheckpointReader(d) as r:
        r.check()
        assert not bool(r.load(tensor).isfinite().all())  # NaN reaches the model: only --verify reports it
