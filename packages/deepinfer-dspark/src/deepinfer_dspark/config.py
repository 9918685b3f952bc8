"""DSparkConfig: the drafter's static numbers (block size, noise token, target layers, Markov rank, window) and
how many drafts one verification may check. Pure Python."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deepinfer_dspark.errors import DSparkConfigError

__all__ = ["DSparkConfig"]


def _int(name: str, value: object, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DSparkConfigError(f"DSparkConfig.{name}: expected an int >= {minimum}, found {value!r}")


@dataclass(frozen=True, kw_only=True)
class DSparkConfig:
    """Defaults are V4.1-Flash's `config.json` (`dspark_*` fields).

    block_size: drafts proposed per round N (`dspark_block_size`); the draft block is [anchor, noise x (N-1)] at
        positions p..p+N-1 and position i predicts token p+1+i.
    noise_token_id: mask token filling the block after the anchor (`dspark_noise_token_id`).
    target_layer_ids: target layers whose hc-stream means feed `main_proj` (`dspark_target_layer_ids`; V4.1 reads
        the layer inputs, V4-0731 the outputs). Distinct, >= 0, in checkpoint order.
    markov_rank: rank r of the low-rank bigram head (`dspark_markov_rank`).
    max_verify: upper bound on drafts verified per request per step (0 disables speculation; <= block_size).
    window: draft sliding-window length (must equal the target's `sliding_window`).
    """

    block_size: int = 5
    noise_token_id: int = 128799
    target_layer_ids: tuple[int, ...] = (37, 38, 39)
    markov_rank: int = 256
    max_verify: int = 5
    window: int = 128

    def __post_init__(self) -> None:
        _int("block_size", self.block_size, 1)
        _int("noise_token_id", self.noise_token_id, 0)
        _int("markov_rank", self.markov_rank, 1)
        _int("max_verify", self.max_verify, 0)
        _int("window", self.window, 1)
        if self.max_verify > self.block_size:
            raise DSparkConfigError(
                f"DSparkConfig.max_verify: expected <= block_size={self.block_size}, found {self.max_verify}"
            )
        ids = self.target_layer_ids
        if not isinstance(ids, tuple) or not ids:
            raise DSparkConfigError(f"DSparkConfig.target_layer_ids: expected a non-empty tuple of ints, found {ids!r}")
        for layer in ids:
            if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
                raise DSparkConfigError(f"DSparkConfig.target_layer_ids: expected ints >= 0, found {ids!r}")
        if len(set(ids)) != len(ids):
            raise DSparkConfigError(f"DSparkConfig.target_layer_ids: expected distinct layer ids, found {ids!r}")

    @property
    def num_target_layers(self) -> int:
        return len(self.target_layer_ids)

    @property
    def verify_len(self) -> int:
        """Target rows of one verification at the maximum: the anchor plus max_verify drafts."""
        return 1 + self.max_verify

    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any], **overrides: Any) -> DSparkConfig:
        """Read the `dspark_*` fields of an HF `config.json` dict (V4.1 nests them in `text_config`); `overrides`
        (e.g. max_verify) win. Raises DSparkConfigError when the config has no DSpark fields."""
        text = config.get("text_config", config)
        if not isinstance(text, Mapping) or "dspark_block_size" not in text:
            raise DSparkConfigError("config: expected dspark_block_size (a DSpark checkpoint), found none")
        fields: dict[str, Any] = {
            "block_size": text["dspark_block_size"],
            "noise_token_id": text.get("dspark_noise_token_id", cls.noise_token_id),
            "target_layer_ids": tuple(text.get("dspark_target_layer_ids", cls.target_layer_ids)),
            "markov_rank": text.get("dspark_markov_rank", cls.markov_rank),
            "window": text.get("sliding_window", cls.window),
        }
        fields["max_verify"] = fields["block_size"]
        fields.update(overrides)
        return cls(**fields)
