"""The ALOE math in plain PyTorch: the specification the kernels are tested against.

Computed in float64 when h is float64, otherwise in float32; the result is
returned in h's dtype.
"""

from __future__ import annotations

import math

import torch

from .operator import DEFAULT_EPS, AloeOperator


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype computes in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def normalize_rows(h: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """Rows of ``h`` in float32 divided by ``max(|row|, eps)``, as the gate normalizes them (zero rows stay zero)."""
    h = h.float()
    return h / torch.linalg.vector_norm(h, dim=-1, keepdim=True).clamp_min(eps)


def _check_input(h: torch.Tensor, op: AloeOperator) -> None:
    if h.shape[-1] != op.d:
        raise ValueError(f"h has last dimension {h.shape[-1]}, but the operator expects d={op.d}")
    if not h.is_floating_point():
        raise TypeError(f"h must be a floating tensor, got {h.dtype}")


def gates_from_scores(
    scores: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor, gate_eps: float
) -> torch.Tensor:
    """Dead-zone sigmoid gate of already normalized scores (..., n)."""
    z = temperatures * (scores - thresholds)
    return torch.clamp_min(torch.sigmoid(z) - gate_eps, 0.0) / (1.0 - gate_eps)


def open_score_floor(thresholds: torch.Tensor, temperatures: torch.Tensor, gate_eps: float) -> torch.Tensor:
    """Per-edit normalized score above which the gate is non-zero.

    g > 0  <=>  sigmoid(alpha (s - tau)) > gate_eps  <=>  s > tau + logit(gate_eps) / alpha.
    Comparing raw scores with this floor needs no sigmoid over all (token, edit) pairs.
    """
    if gate_eps <= 0:
        return torch.full_like(thresholds, -math.inf)
    logit = math.log(gate_eps / (1.0 - gate_eps))
    return thresholds + logit / temperatures


def aloe_gates(h: torch.Tensor, op: AloeOperator) -> torch.Tensor:
    """Gates g(h) of shape (..., n), in the compute dtype (float64 for float64 h, else float32)."""
    _check_input(h, op)
    ct = compute_dtype(h.dtype)
    hc = h.to(ct)
    # max(|h|, eps) keeps a zero row finite: its scores are 0 and its gates
    # are whatever sigmoid(-alpha * tau) gives.
    norm = torch.linalg.vector_norm(hc, dim=-1, keepdim=True).clamp_min(op.eps)
    scores = (hc / norm) @ op.addresses.to(device=h.device, dtype=ct).T
    return gates_from_scores(
        scores,
        op.thresholds.to(device=h.device, dtype=ct),
        op.temperatures.to(device=h.device, dtype=ct),
        op.gate_eps,
    )


def aloe_reference(h: torch.Tensor, op: AloeOperator) -> torch.Tensor:
    """The residual U g(h), shape (..., d_out), in h's dtype."""
    g = aloe_gates(h, op)
    return (g @ op.writes.to(device=h.device, dtype=g.dtype)).to(h.dtype)
