"""When the TP=1 layer takes the screened CPU path, and its screen GEMM operand on vLLM's CPU backend.

The math of the path is :mod:`aloe_kernels.screened`; this module holds what
depends on vLLM (its oneDNN GEMM), the layer's fixed-shape screen buffers
(refreshed in place after a live swap), and the plugin's settings:

- ``ALOE_VLLM_SCREEN``: ``auto`` (default), ``1`` or ``0`` (see :func:`screening_enabled`);
- ``ALOE_VLLM_SCREEN_MIN_N``: the smallest operator screened in ``auto`` mode (default 256);
- ``ALOE_VLLM_SCREEN_ONEDNN``: ``0`` screens with ``torch.matmul`` instead of
  vLLM's prepacked oneDNN GEMM.
"""

from __future__ import annotations

import os

import torch

from aloe_kernels.runtime import triton_interpreting
from aloe_kernels.screened import fast_bf16_cpu, screen_limit

__all__ = ["refresh_screen_", "screen_buffers", "screening_enabled"]

# Packed oneDNN matrices by the address of the handle buffer they serve: a handler frees its matrix
# when collected, so it lives until a swap replaces it (between two forward passes).
_SCREEN_HANDLERS: dict[int, object] = {}


def _onednn(device: torch.device):
    """vLLM's ``_custom_ops`` when its oneDNN CPU GEMM is usable for the screen, else None."""
    if os.environ.get("ALOE_VLLM_SCREEN_ONEDNN", "1") == "0" or device.type != "cpu":
        return None
    try:
        from vllm import _custom_ops as vllm_ops
    except Exception:  # no vLLM: plain matmul
        return None
    return vllm_ops if vllm_ops._supports_onednn else None


def screen_buffers(slots: int, addresses: torch.Tensor) -> dict[str, torch.Tensor]:
    """Fixed-shape buffers of the screened path for a layer of ``slots`` slots (filled by :func:`refresh_screen_`).

    ``aloe_addresses_lo``: (slots, d) bf16 addresses; ``aloe_screen_handle``: the handle of the
    prepacked oneDNN matrix of the live rows (0-dim int64; 0 = none, screen with
    ``aloe_addresses_lo``); ``aloe_limit_lo``: (slots,) bf16 screen limits (+inf for inert slots,
    which never pass).
    """
    d, dev = addresses.shape[1], addresses.device
    return {
        "aloe_addresses_lo": torch.zeros((slots, d), dtype=torch.bfloat16, device=dev),
        "aloe_screen_handle": torch.zeros((), dtype=torch.int64, device=dev),
        "aloe_limit_lo": torch.full((slots,), float("inf"), dtype=torch.bfloat16, device=dev),
    }


def refresh_screen_(addresses_lo: torch.Tensor, handle: torch.Tensor, limit_lo: torch.Tensor,
                    addresses: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor,
                    gate_eps: float, active: int) -> None:
    """Refill the screen buffers in place for the first ``active`` (live) slots; the rest are screened out."""
    limit_lo[:active].copy_(screen_limit(addresses[:active].detach(), thresholds[:active].detach(),
                                         temperatures[:active].detach(), gate_eps))
    limit_lo[active:].fill_(float("inf"))
    a_lo = addresses[:active].detach().to(torch.bfloat16).contiguous()
    addresses_lo[:active].copy_(a_lo)
    vllm_ops = _onednn(a_lo.device)
    handler = None
    if vllm_ops is not None and active:
        try:  # pack only the live rows: the screen then costs nothing for the inert ones
            handler = vllm_ops.create_onednn_mm(a_lo.t(), 32)
        except RuntimeError:  # a shape oneDNN declines: torch.matmul over addresses_lo
            handler = None
    handle.fill_(0 if handler is None else int(handler.handler_tensor))
    # Dropping the replaced handler frees its packed matrix; nothing uses it any more.
    _SCREEN_HANDLERS.pop(handle.data_ptr(), None)
    if handler is not None:
        _SCREEN_HANDLERS[handle.data_ptr()] = handler


def screening_enabled(n: int, device: torch.device, tp_size: int) -> bool:
    """Whether the TP=1 layer takes the screened CPU path.

    ``ALOE_VLLM_SCREEN``: ``auto`` (default: CPU, one rank, no Triton interpreter,
    fast bf16, n >= ``ALOE_VLLM_SCREEN_MIN_N``, default 256), ``1`` (on CPU
    whenever possible, for tests), ``0`` (never).
    """
    mode = os.environ.get("ALOE_VLLM_SCREEN", "auto").lower()
    if mode in ("0", "off", "false") or device.type != "cpu" or tp_size != 1 or n == 0:
        return False
    if triton_interpreting():
        return False  # the Triton kernel is what is being exercised then
    if mode in ("1", "on", "true"):
        return True
    return fast_bf16_cpu() and n >= int(os.environ.get("ALOE_VLLM_SCREEN_MIN_N", "256"))
