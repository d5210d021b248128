"""Fused Triton kernels. Importing this package never fails without Triton;
``kernel_available()`` says whether the kernels can run.

``aloe_gate.py`` holds the fused gate kernel (single pass for one rank) and
the two-phase tensor-parallel variant; see its module docstring for the design.
"""

from __future__ import annotations

import torch

_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def kernel_available() -> bool:
    """Whether Triton is importable (the kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_residual_(y: torch.Tensor, h: torch.Tensor, op, deterministic: bool = False) -> torch.Tensor:
    """Add U g(h) into y with the fused kernel (see ``aloe_gate.py``).

    float64 inputs (not supported by the kernel) take the PyTorch sparse path.
    """
    if any(t.dtype not in _KERNEL_DTYPES for t in (y, h, op.addresses, op.writes)):
        from ..residual import sparse_residual_

        return sparse_residual_(y, h, op)
    from .aloe_gate import aloe_gate_residual_

    return aloe_gate_residual_(
        y, h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps, deterministic
    )


def aloe_gate_residual_(*args, **kwargs):
    """Lazy alias of :func:`aloe_kernels.ops.aloe_gate.aloe_gate_residual_`."""
    from .aloe_gate import aloe_gate_residual_ as fn

    return fn(*args, **kwargs)


def aloe_gate_partial_scores(*args, **kwargs):
    """Lazy alias of :func:`aloe_kernels.ops.aloe_gate.aloe_gate_partial_scores` (TP phase A)."""
    from .aloe_gate import aloe_gate_partial_scores as fn

    return fn(*args, **kwargs)


def aloe_gate_apply_(*args, **kwargs):
    """Lazy alias of :func:`aloe_kernels.ops.aloe_gate.aloe_gate_apply_` (TP phase B)."""
    from .aloe_gate import aloe_gate_apply_ as fn

    return fn(*args, **kwargs)


__all__ = ["kernel_available", "fused_residual_", "aloe_gate_residual_", "aloe_gate_partial_scores", "aloe_gate_apply_"]
