"""Where the fused Triton kernels can run, decided once for every caller.

The kernels run on CUDA tensors, and on CPU tensors when Triton runs in its
interpreter (``TRITON_INTERPRET=1``, so that they are testable without a GPU).
Nothing here imports Triton at module import.
"""

from __future__ import annotations

import os

import torch

__all__ = [
    "KERNEL_DTYPES",
    "STREAM_MAX_TOKENS",
    "kernel_available",
    "kernel_dtypes",
    "triton_interpreting",
    "use_fused_kernel",
]

#: Tensor dtypes the fused kernels take (h, addresses, writes, y); float64 stays in PyTorch.
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Most tokens a call of the streaming decode kernel takes (its token side is one tile of 16 or 32).
STREAM_MAX_TOKENS = 32


def triton_interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_import_error() -> str | None:
    """Why Triton does not import here, or None when it does."""
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def kernel_available() -> bool:
    """Whether Triton is importable (the kernels run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    return _triton_import_error() is None


def use_fused_kernel(h: torch.Tensor) -> bool:
    """Whether a call on ``h``'s device takes the Triton kernel (dtypes aside: see :func:`kernel_dtypes`).

    On CUDA the kernel is required: without Triton this raises, naming the import error, rather
    than falling back to the PyTorch path, which synchronises the host (``nonzero``) and cannot be
    captured in a CUDA graph.
    """
    if not (h.is_cuda or triton_interpreting()):
        return False
    missing = _triton_import_error()
    if missing is not None and h.is_cuda:
        raise RuntimeError(
            f"ALOE on CUDA runs its fused Triton kernel, and Triton does not import ({missing}); install the "
            "Triton that matches this PyTorch"
        )
    return missing is None


def kernel_dtypes(*tensors: torch.Tensor) -> bool:
    """Whether every tensor has a dtype the kernels take (:data:`KERNEL_DTYPES`)."""
    return all(t.dtype in KERNEL_DTYPES for t in tensors)
