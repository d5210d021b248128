"""Where the fused Triton kernels can run, decided once for every caller.

The kernels run on CUDA tensors, and on CPU tensors when Triton runs in its
interpreter (``TRITON_INTERPRET=1``, so that they are testable without a GPU).
Nothing here imports Triton at module import.
"""

from __future__ import annotations

import os

import torch

__all__ = ["KERNEL_DTYPES", "kernel_available", "kernel_dtypes", "triton_interpreting", "use_fused_kernel"]

#: Tensor dtypes the fused kernels take (h, addresses, writes, y); float64 stays in PyTorch.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_available() -> bool:
    """Whether Triton is importable (the kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_fused_kernel(h: torch.Tensor) -> bool:
    """Whether a call on ``h``'s device takes the Triton kernel (dtypes aside: see :func:`kernel_dtypes`)."""
    if not (h.is_cuda or triton_interpreting()):
        return False
    return kernel_available()


def kernel_dtypes(*tensors: torch.Tensor) -> bool:
    """Whether every tensor has a dtype the kernels take (:data:`KERNEL_DTYPES`)."""
    return all(t.dtype in KERNEL_DTYPES for t in tensors)
