"""Device buffers of the kernel launchers: uninitialised workspaces, ticket counters, the launch device.

Launchers call :func:`empty_workspace` through this module (``buffers.empty_workspace``), so that a
test can poison every workspace of every launcher in one place.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["device_guard", "empty_workspace", "ticket_counters"]

#: Zeroed int32 counters per device, grown on demand. Kernels that take tickets from them put each
#: counter back to 0 before they finish, so they are zero between launches without a memset.
_COUNTERS: dict[torch.device, torch.Tensor] = {}


def empty_workspace(shape: tuple, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Uninitialised kernel workspace (every element a kernel reads, it wrote first)."""
    return torch.empty(shape, device=device, dtype=dtype)


def ticket_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 counters on ``device``, all zero between launches (kept per device).

    One buffer per device: launches that use it must not run concurrently on two streams of the
    same device (the ALOE layers of one model run in sequence on one stream).
    """
    have = _COUNTERS.get(device)
    if have is None or have.numel() < count:
        size = max(count, 1024, 2 * (have.numel() if have is not None else 0))
        have = torch.zeros(size, device=device, dtype=torch.int32)
        _COUNTERS[device] = have
    return have


def device_guard(t: torch.Tensor):
    """Make ``t``'s CUDA device current for a launch (Triton launches on the current device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
