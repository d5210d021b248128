"""Input checks of the public kernel entry points: each error names the argument and what was expected.

They run on the host before a custom op is called, so that a bad call fails
with a clear message rather than inside a kernel launch.
"""

from __future__ import annotations

import math

import torch

from ..runtime import KERNEL_DTYPES, triton_interpreting

__all__ = ["PARAM_DTYPES", "check_devices", "check_eps", "check_params", "check_tensor", "check_y"]

#: dtypes accepted for thresholds and temperatures (read as fp32 by the kernels).
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_tensor(name: str, t: object, dtypes: tuple = KERNEL_DTYPES) -> None:
    """``t`` is a tensor of one of ``dtypes``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(x).replace("torch.", "") for x in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; the fused kernel supports {names}")


def check_devices(**tensors: torch.Tensor) -> None:
    """All tensors on one device, where the kernels run (CUDA, or CPU under the interpreter)."""
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        desc = ", ".join(f"{k} on {v}" for k, v in devices.items())
        raise ValueError(f"all tensors must be on one device, got {desc}")
    dev = next(iter(devices.values()))
    if dev.type != "cuda" and not triton_interpreting():
        raise ValueError(f"the fused kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {dev}")


def check_eps(eps: float, gate_eps: float) -> None:
    """``eps`` finite and > 0, ``gate_eps`` in [0, 1)."""
    if not (math.isfinite(float(eps)) and float(eps) > 0):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    if not (0.0 <= float(gate_eps) < 1.0):
        raise ValueError(f"gate_eps must be in [0, 1), got {gate_eps!r}")


def check_y(y: torch.Tensor, lead: tuple, d_out: int, what: str) -> None:
    """``y`` has shape ``lead + (d_out,)`` and can be viewed as (tokens, d_out), so it is updated in place."""
    if tuple(y.shape) != tuple(lead) + (d_out,):
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {tuple(lead) + (d_out,)} for {what}")
    if y.dim() >= 2 and y.numel() > 0:
        try:
            y.view(-1, d_out)
        except RuntimeError as exc:
            raise ValueError(
                f"y (shape {tuple(y.shape)}, strides {y.stride()}) must be viewable as "
                f"(tokens, {d_out}) so it can be updated in place"
            ) from exc


def check_params(n: int, thresholds: torch.Tensor, temperatures: torch.Tensor, writes: torch.Tensor) -> None:
    """thresholds and temperatures (n,), writes (n, d_out) with d_out >= 1."""
    for name, t in (("thresholds", thresholds), ("temperatures", temperatures)):
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},)")
    if writes.dim() != 2 or writes.shape[0] != n or writes.shape[1] < 1:
        raise ValueError(f"writes has shape {tuple(writes.shape)}, expected ({n}, d_out)")
