"""Lightning indexer for V4.1 CSA2 (docs/model.md §C.4): scores, causal top-k with -1 padding, candidates.

Only the pure-torch reference exists so far; GPU kernels will be dispatched from these same names.
"""

from deepinfer_kernels.indexer.reference import (
    candidate_blocks,
    causal_mask,
    index_scores,
    topk_indices,
    visible_counts,
)

__all__ = ["candidate_blocks", "causal_mask", "index_scores", "topk_indices", "visible_counts"]
