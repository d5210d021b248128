"""``aloe_residual_``: add U g(h) into a down-projection output, in place.

Dispatch: the fused Triton kernel on CUDA tensors (and on CPU tensors when
``TRITON_INTERPRET=1``, so that the kernel is testable without a GPU);
otherwise a sparse-aware PyTorch path that reads only the write rows of
edits whose gate is non-zero for some token of the batch.
"""

from __future__ import annotations

import math
import os

import torch

from .operator import AloeOperator
from .reference import _check_input, compute_dtype, gates_from_scores


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_fused_kernel(h: torch.Tensor) -> bool:
    """Whether ``aloe_residual_`` takes the Triton kernel for this input."""
    if not (h.is_cuda or triton_interpreting()):
        return False
    from .ops import kernel_available

    return kernel_available()


def open_score_floor(op: AloeOperator) -> torch.Tensor:
    """Per-edit normalized score above which the gate is non-zero.

    g > 0  <=>  sigmoid(alpha (s - tau)) > gate_eps  <=>  s > tau + logit(gate_eps) / alpha.
    Comparing raw scores with this floor needs no sigmoid over all (token, edit) pairs.
    """
    if op.gate_eps <= 0:
        return torch.full_like(op.thresholds, -math.inf)
    logit = math.log(op.gate_eps / (1.0 - op.gate_eps))
    return op.thresholds + logit / op.temperatures


def sparse_residual_(y: torch.Tensor, h: torch.Tensor, op: AloeOperator) -> torch.Tensor:
    """The PyTorch path: dense scores, then only the write rows of open edits."""
    ct = compute_dtype(h.dtype)
    h2 = h.reshape(-1, op.d)
    if h2.shape[0] == 0 or op.n == 0:
        return y
    hc = h2.to(ct)
    # Normalizing after the GEMM scales T x n scores instead of T x d inputs.
    raw = hc @ _as(op.addresses, ct).T
    inv_norm = 1.0 / torch.linalg.vector_norm(hc, dim=-1, keepdim=True).clamp_min(op.eps)
    scores = raw * inv_norm
    floor = open_score_floor(op).to(device=h.device, dtype=ct)
    open_any = (scores > floor).any(dim=0)
    idx = open_any.nonzero().squeeze(1)
    if idx.numel() == 0:
        return y
    s = scores.index_select(1, idx)
    g = gates_from_scores(
        scores.index_select(1, idx),
        op.thresholds.index_select(0, idx).to(ct),
        op.temperatures.index_select(0, idx).to(ct),
        op.gate_eps,
    )
    delta = g @ op.writes.index_select(0, idx).to(ct)
    y.add_(delta.to(y.dtype).view(*y.shape[:-1], op.d_out))
    return y


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def aloe_residual_(y: torch.Tensor, h: torch.Tensor, op: AloeOperator, deterministic: bool = False) -> torch.Tensor:
    """Add ``U g(h)`` into ``y`` in place and return ``y``.

    ``h`` has shape (..., d) (any strides), ``y`` shape (..., d_out) with the
    same leading dimensions. ``deterministic`` asks the fused kernel for
    run-to-run identical bits (the PyTorch path is deterministic anyway).
    """
    _check_input(h, op)
    if y.shape[:-1] != h.shape[:-1] or y.shape[-1] != op.d_out:
        raise ValueError(
            f"y has shape {tuple(y.shape)}, expected {tuple(h.shape[:-1]) + (op.d_out,)} for h of shape {tuple(h.shape)}"
        )
    if op.device != h.device:
        raise ValueError(f"operator is on {op.device} but h is on {h.device}; call op.to(h.device) once")
    if use_fused_kernel(h):
        from .ops import fused_residual_

        return fused_residual_(y, h, op, deterministic=deterministic)
    return sparse_residual_(y, h, op)
