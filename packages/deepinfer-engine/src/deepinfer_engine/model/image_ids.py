"""Image positions of V4.1 vision checkpoints (docs/fidelity.md §2): ids just past the tokenizer vocabulary.

DeepSeek's inference code marks image-span positions with ids in ``[vocab_size, vocab_size + 5)`` (image start,
pad, image, newline, end) — ids no tokenizer produces — or with the processor's token-type mask. It never uses the
config's ``image_token_id`` for this: that id is an ordinary vocabulary token and text is text. At image positions
the MoE gate selects with ``bias_vl``, the Engram gate is 0 and n-grams break; their token embedding is 0 (the
vision tower's embeddings replace it when images are given).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["IMAGE_ID_SPAN", "accepts_image_ids", "image_positions", "max_input_id"]

IMAGE_ID_SPAN = 5
"""Number of image ids after the vocabulary: ``[vocab_size, vocab_size + IMAGE_ID_SPAN)``."""


def accepts_image_ids(args: object) -> bool:
    """V4.1 checkpoints with a vision config take image-position ids; every other model takes text ids only."""
    return getattr(args, "arch", None) == "v41" and getattr(args, "vision_config", None) is not None


def max_input_id(args: object) -> int:
    """One past the largest id the model accepts: vocab_size, or vocab_size + 5 with image ids."""
    return args.vocab_size + (IMAGE_ID_SPAN if accepts_image_ids(args) else 0)


def image_positions(input_ids: Tensor, vocab_size: int) -> Tensor:
    """``[T] bool``: positions whose id is an image id (``>= vocab_size``; validated ids stay below +5)."""
    return input_ids >= vocab_size
