"""Fused Triton kernels. Importing this package never fails without Triton;
``kernel_available()`` says whether the kernels can run."""

from __future__ import annotations

import torch


def kernel_available() -> bool:
    """Whether Triton is importable (the kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_residual_(y: torch.Tensor, h: torch.Tensor, op, deterministic: bool = False) -> torch.Tensor:
    """Add U g(h) into y with the fused kernel (see ``aloe_gate.py``)."""
    from .aloe_gate import aloe_gate_residual_

    return aloe_gate_residual_(
        y, h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps, deterministic
    )
