"""ROME's closed-form update (Meng et al., 2022, Eq. 2): the rank-one change of a linear layer
W (d_out, d) that maps the key k to the value v exactly while moving the keys the layer usually sees,
weighted by their second moment C, as little as possible:

    dW = (v - W k) (C^-1 k)^T / (k^T C^-1 k)

so that (W + dW) k = v, and dW x = 0 for every x with k^T C^-1 x = 0.
"""

from __future__ import annotations

import torch


def rank_one_update(
    W: torch.Tensor, C: torch.Tensor, k: torch.Tensor, v: torch.Tensor, direction: torch.Tensor | None = None
) -> torch.Tensor:
    """dW (d_out, d) in float64 for the key ``k`` (d,) and value ``v`` (d_out,); ``C`` (d, d) must be
    symmetric positive definite (a second moment of a layer's inputs over enough tokens is).

    ``direction`` (default ``k``) is the key whose C^-1 image the change lies along: ROME takes it
    averaged over context prefixes while mapping the plain prompt's key ``k`` exactly."""
    if W.dim() != 2 or C.shape != (W.shape[1], W.shape[1]) or k.shape != (W.shape[1],) or v.shape != (W.shape[0],):
        raise ValueError(
            f"rank_one_update: shapes W {tuple(W.shape)}, C {tuple(C.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    W, C, k, v = (t.double() for t in (W, C, k, v))
    u = torch.linalg.solve(C, k if direction is None else direction.double())  # C^-1 k, no inverse formed
    return torch.outer(v - W @ k, u) / (k @ u)
