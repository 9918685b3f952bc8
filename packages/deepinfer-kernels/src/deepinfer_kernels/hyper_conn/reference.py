"""Pure-torch reference of mHC (docs/model.md §A.3): mixes with Sinkhorn, pre-collapse, post-combine, head.

R: [T, n, d] residual streams. All mixing math in fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sinkhorn(c0: Tensor, iters: int, eps: float) -> Tensor:
    """Row softmax + eps, column-normalise, then (iters-1) x (rows, columns). c0: [..., n, n] fp32."""
    c = torch.softmax(c0.float(), dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def _mix_logits(r: Tensor, fn: Tensor, rms_eps: float) -> Tensor:
    f = r.flatten(-2).float()  # [T, n*d]
    return (f @ fn.float().T) * torch.rsqrt(f.square().mean(dim=-1, keepdim=True) + rms_eps)


def hc_mix(
    r: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, sinkhorn_iters: int, hc_eps: float, rms_eps: float
) -> tuple[Tensor, Tensor, Tensor]:
    """pre [T, n], post [T, n], comb [T, n, n] (fp32) of one sub-layer."""
    n = r.shape[-2]
    m = _mix_logits(r, fn, rms_eps)  # [T, (2+n)*n]
    base = base.float()
    scale = scale.float()
    pre = torch.sigmoid(m[:, :n] * scale[0] + base[:n]) + hc_eps
    post = 2.0 * torch.sigmoid(m[:, n : 2 * n] * scale[1] + base[n : 2 * n])
    c0 = (m[:, 2 * n :] * scale[2] + base[2 * n :]).view(-1, n, n)
    return pre, post, sinkhorn(c0, sinkhorn_iters, hc_eps)


def hc_pre(r: Tensor, pre: Tensor) -> Tensor:
    """x = sum_i pre_i R_i in fp32, cast to R's dtype: [T, d]."""
    return torch.einsum("tn,tnd->td", pre.float(), r.float()).to(r.dtype)


def hc_post(y: Tensor, r: Tensor, post: Tensor, comb: Tensor) -> Tensor:
    """R'_j = post_j * y + sum_i comb[i, j] R_i (contract over the FIRST index): [T, n, d] in R's dtype."""
    out = post.float()[:, :, None] * y.float()[:, None, :] + torch.einsum("tij,tid->tjd", comb.float(), r.float())
    return out.to(r.dtype)


def hc_head(r: Tensor, fn: Tensor, base: Tensor, scale: Tensor, *, hc_eps: float, rms_eps: float) -> Tensor:
    """Learned V4 head collapse: pre = sigmoid(m*scale + base) + eps; h = sum_i pre_i R_i -> [T, d]."""
    m = _mix_logits(r, fn, rms_eps)  # [T, n]
    pre = torch.sigmoid(m * scale.float()[0] + base.float()) + hc_eps
    return hc_pre(r, pre)
