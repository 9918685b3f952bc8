"""The one name table between checkpoint tensors and model parameters (pure Python, no torch).

Module names equal the official checkpoint names (docs/quantized_weights.md), with one structural exception: routed experts are stacked per layer, so checkpoint tensor
``layers.{l}.ffn.experts.{e}.{w1|w2|w3}.{weight|scale}`` is slot e of parameter
``layers.{l}.ffn.experts.{w1|w2|w3}.{weight|scale}``. A rename, if ever needed, goes into `MODULE_TO_CHECKPOINT`.
"""

from __future__ import annotations

import re
from types import MappingProxyType

__all__ = ["MODULE_TO_CHECKPOINT", "checkpoint_name", "checkpoint_to_param", "param_to_checkpoint"]

# module state-dict name -> official checkpoint name, where they differ (none so far).
MODULE_TO_CHECKPOINT: MappingProxyType[str, str] = MappingProxyType({})
_CHECKPOINT_TO_MODULE = MappingProxyType({v: k for k, v in MODULE_TO_CHECKPOINT.items()})

_EXPERT_TENSOR = re.compile(r"^(?P<pre>.*\.ffn\.experts)\.(?P<e>\d+)\.(?P<w>w[123])\.(?P<leaf>weight|scale)$")
_STACKED_PARAM = re.compile(r"^(?P<pre>.*\.ffn\.experts)\.(?P<w>w[123])\.(?P<leaf>weight|scale)$")


def checkpoint_name(module_name: str) -> str:
    return MODULE_TO_CHECKPOINT.get(module_name, module_name)


def checkpoint_to_param(name: str) -> tuple[str, int | None]:
    """Checkpoint tensor name -> (parameter name, expert slot or None)."""
    m = _EXPERT_TENSOR.match(name)
    if m is not None:
        return f"{m['pre']}.{m['w']}.{m['leaf']}", int(m["e"])
    return _CHECKPOINT_TO_MODULE.get(name, name), None


def param_to_checkpoint(param_name: str, leading_dim: int) -> list[tuple[str, int | None]]:
    """Parameter name (and its first dimension, the expert count of a stacked parameter) -> every checkpoint
    tensor it holds, with the slot each one fills."""
    m = _STACKED_PARAM.match(param_name)
    if m is not None:
        return [(f"{m['pre']}.{e}.{m['w']}.{m['leaf']}", e) for e in range(leading_dim)]
    return [(checkpoint_name(param_name), None)]
