"""TIES merging (Yadav et al., 2023) of WISE's side memories, as EasyEdit's ``merge_alg: ties``.

Each memory is read as a task vector, its change from the base weight. TIES then

1. *trims* each task vector to its ``density`` share of entries of largest magnitude (the others set to 0);
2. *elects* a sign per entry: the sign of the sum of the weighted, trimmed task vectors (ties go to +);
3. *merges* per entry the weighted task vectors whose sign agrees with the elected one, divided by the sum
   of their weights (a zero entry has no sign and never agrees), and adds that to the base.

With equal weights step 3 is the mean of the agreeing entries ("disjoint mean").
"""

from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["magnitude_trim", "ties_merge"]


def magnitude_trim(delta: torch.Tensor, density: float) -> torch.Tensor:
    """``delta`` with all but its ``int(density * numel)`` entries of largest magnitude set to zero."""
    if density >= 1:
        return delta
    k = int(density * delta.numel())
    if k <= 0:
        raise ValueError(f"density {density} keeps no entry of a tensor of {delta.numel()}")
    keep = torch.zeros(delta.numel(), dtype=delta.dtype, device=delta.device)
    keep[torch.topk(delta.abs().reshape(-1).float(), k).indices] = 1
    return delta * keep.view_as(delta)


def ties_merge(base: torch.Tensor, tensors: Sequence[torch.Tensor], weights: Sequence[float], density: float) -> torch.Tensor:
    """The TIES merge of ``tensors`` (each the shape of ``base``) around ``base``, one weight per tensor."""
    if len(tensors) != len(weights) or not tensors:
        raise ValueError("ties_merge needs one weight per tensor and at least one tensor")
    deltas = torch.stack([magnitude_trim(t - base, density) for t in tensors])
    w = torch.tensor(list(weights), dtype=deltas.dtype, device=deltas.device).view(-1, *([1] * base.dim()))
    weighted = deltas * w
    elected = torch.where(weighted.sum(0) >= 0, 1.0, -1.0).to(deltas.dtype)
    agree = (weighted.sign() == elected).to(deltas.dtype)
    divisor = (w * agree).sum(0)
    divisor[divisor == 0] = 1
    return (base + (weighted * agree).sum(0) / divisor).to(base.dtype)
