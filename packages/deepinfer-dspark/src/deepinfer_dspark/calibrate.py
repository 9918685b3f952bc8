"""Post-hoc confidence calibration: per-position temperature scaling (STS) of the Confidence Head's logit.

c_i = sigmoid(z_i / T_i). `fit_sts` picks each T_i from a log-spaced grid by minimising the binary cross-entropy
against observed acceptance (0/1 outcomes or the analytic probability sum_v min(p, q)), on the samples that reached
position i (every earlier draft accepted), because c_i is a conditional probability. Deterministic; host-side.
"""

from __future__ import annotations

import torch
from torch import Tensor

from deepinfer_dspark.errors import DSparkInputError

__all__ = ["fit_sts"]


def fit_sts(logits: Tensor, targets: Tensor, reached: Tensor | None = None, *, grid: Tensor | None = None) -> tuple[float, ...]:
    """Per-position temperatures for `DraftHeads(sts=...)`.

    logits: `[M, N]` confidence logits z (before the sigmoid) of M blocks.
    targets: `[M, N]` acceptance in [0, 1] (indicators or probabilities).
    reached: `[M, N] bool`, which samples count at each position (default: all).
    grid: candidate temperatures (default 121 values log-spaced in [1/32, 32]); ties pick the smallest.
    Positions without samples keep T = 1.
    """
    if logits.dim() != 2 or logits.shape != targets.shape:
        raise DSparkInputError(
            f"logits / targets: expected equal [M, N] shapes, found {tuple(logits.shape)} / {tuple(targets.shape)}"
        )
    if reached is not None and reached.shape != logits.shape:
        raise DSparkInputError(f"reached: expected shape {tuple(logits.shape)}, found {tuple(reached.shape)}")
    y = targets.to(torch.float64)
    if bool(((y < 0) | (y > 1)).any()):
        raise DSparkInputError("targets: expected values in [0, 1]")
    t = torch.logspace(-5, 5, 121, base=2.0, dtype=torch.float64) if grid is None else grid.to(torch.float64)
    if bool((t <= 0).any()):
        raise DSparkInputError("grid: expected temperatures > 0")
    z = logits.to(torch.float64)
    mask = torch.ones_like(z, dtype=torch.bool) if reached is None else reached.to(torch.bool)
    out = []
    for j in range(z.shape[1]):
        zj, yj = z[mask[:, j], j], y[mask[:, j], j]
        if zj.numel() == 0:
            out.append(1.0)
            continue
        s = zj[None, :] / t[:, None]  # [G, M]
        # BCE with logits, stable: log(1 + e^s) - y s
        loss = (torch.nn.functional.softplus(s) - yj[None, :] * s).mean(1)
        out.append(float(t[int(torch.argmin(loss))]))
    return tuple(out)
