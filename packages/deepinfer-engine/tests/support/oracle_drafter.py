"""A stand-in DSpark `DraftModel` for engine tests: it proposes each request's known continuation, so acceptance
is known in advance without a trained draft model."""

from __future__ import annotations

import torch
from deepinfer_dspark import DraftBlock, DraftHeads


class OracleDrafter:
    """Proposes the known continuation of each request (`seq_of_slot(slot)`: the full reference token sequence of
    the request in that cache slot, prompt + plain greedy output), wrong at positions q with q % 4 == 0 or
    q % 7 == 1, so rounds accept 0 .. 3 drafts; past the known sequence (sampled requests) it proposes id 7."""

    def __init__(self, vocab: int, seq_of_slot, *, block_size: int = 5) -> None:
        self.block_size, self.vocab, self.seq_of_slot = block_size, vocab, seq_of_slot
        w = torch.zeros(vocab, 2)
        conf = torch.tensor([[1.0, 0.0, 0.0, 0.0]])  # hidden[0] carries a confidence logit
        self.heads = DraftHeads(markov_embed=w, markov_head=w, confidence=conf)
        self.slots = None
        self.round_host = None

    def draft_block(self, anchor_ids, anchor_positions) -> DraftBlock:
        b, n = anchor_ids.shape[0], self.block_size
        logits = torch.zeros(b, n, self.vocab)
        hidden = torch.zeros(b, n, 2)
        for i, (slot, p) in enumerate(zip(self.slots.tolist(), anchor_positions.tolist())):
            seq = self.seq_of_slot(slot)
            for j in range(n):
                q = p + 1 + j
                right = q < len(seq) and q % 4 != 0 and q % 7 != 1
                tok = seq[q] if q < len(seq) else 7
                logits[i, j, tok if right else (tok + 1) % self.vocab] = 30.0
                hidden[i, j, 0] = 4.0 if right else -4.0
        return DraftBlock(base_logits=logits, hidden=hidden)
