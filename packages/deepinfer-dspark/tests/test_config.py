"""DSparkConfig: V4.1 defaults, reading config.json, typed validation errors."""

from __future__ import annotations

import dataclasses

import pytest
from deepinfer_dspark import DSparkConfig, DSparkConfigError

# The DSpark-relevant part of V4.1-Flash's config.json (nested under text_config, like the release).
V41_CONFIG = {
    "model_type": "deepseek_v41",
    "text_config": {
        "sliding_window": 128,
        "num_nextn_predict_layers": 3,
        "dspark_block_size": 5,
        "dspark_noise_token_id": 128799,
        "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256,
    },
}


def test_defaults_are_v41():
    c = DSparkConfig()
    assert (c.block_size, c.noise_token_id, c.target_layer_ids, c.markov_rank, c.max_verify, c.window) == (
        5, 128799, (37, 38, 39), 256, 5, 128
    )
    assert c.verify_len == 6 and c.num_target_layers == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.block_size = 3  # type: ignore[misc]


def test_from_v41_config():
    c = DSparkConfig.from_config_dict(V41_CONFIG, max_verify=3)
    assert c.block_size == 5 and c.target_layer_ids == (37, 38, 39) and c.markov_rank == 256
    assert c.noise_token_id == 128799 and c.window == 128 and c.max_verify == 3


def test_from_flat_config_and_missing_fields():
    c = DSparkConfig.from_config_dict(
        {"dspark_block_size": 4, "dspark_target_layer_ids": [40, 41, 42], "sliding_window": 64}
    )
    assert (c.block_size, c.max_verify, c.target_layer_ids, c.window) == (4, 4, (40, 41, 42), 64)
    with pytest.raises(DSparkConfigError, match="dspark_block_size"):
        DSparkConfig.from_config_dict({"hidden_size": 8})


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"block_size": 0}, "block_size"),
        ({"max_verify": 6}, "max_verify"),
        ({"max_verify": -1}, "max_verify"),
        ({"noise_token_id": -1}, "noise_token_id"),
        ({"markov_rank": 0}, "markov_rank"),
        ({"target_layer_ids": ()}, "target_layer_ids"),
        ({"target_layer_ids": [37, 38]}, "target_layer_ids"),
        ({"target_layer_ids": (37, 37)}, "target_layer_ids"),
        ({"target_layer_ids": (37, -1)}, "target_layer_ids"),
        ({"window": 0}, "window"),
        ({"block_size": 5.0}, "block_size"),
    ],
)
def test_invalid(kwargs, field):
    with pytest.raises(DSparkConfigError, match=field):
        DSparkConfig(**kwargs)
