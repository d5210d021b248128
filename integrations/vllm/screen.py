"""When the TP=1 layer takes a screened CPU path, and the screen's operands on vLLM's CPU backend.

The math of the paths is :mod:`aloe_kernels.screened` (bf16, for CPUs with bf16 dot products) and
:mod:`aloe_kernels.screened_int8` (int8, for the others); this module holds what depends on vLLM
(its oneDNN GEMM), the layer's fixed-shape screen buffers (refreshed in place after a live swap),
and the plugin's settings:

- ``ALOE_VLLM_SCREEN``: ``auto`` (default), ``bf16`` (or ``1``), ``int8`` or ``0`` (see :func:`screen_kind`);
- ``ALOE_VLLM_SCREEN_MIN_N``: the smallest operator screened in ``auto`` mode (default 256);
- ``ALOE_VLLM_SCREEN_ONEDNN``: ``0`` screens with ``torch.matmul`` instead of
  vLLM's prepacked oneDNN GEMM.
"""

from __future__ import annotations

import os

import torch

from aloe_kernels.runtime import triton_interpreting
from aloe_kernels.screened import SCREEN_MIN_EDITS, fast_bf16_cpu, screen_limit
from aloe_kernels.screened_int8 import Int8Screen, int8_screen_supported

__all__ = ["int8_screen_of", "refresh_int8_screen_", "refresh_screen_", "screen_buffers", "screen_kind"]

# Packed oneDNN matrices by the address of the handle buffer they serve: a handler frees its matrix
# when collected, so it lives until a swap replaces it (between two forward passes).
_SCREEN_HANDLERS: dict[int, object] = {}
# Int8 screens by the key their layer's handle buffer holds (a packed int8 matrix is no tensor, so the
# op, opaque to torch.compile, looks it up); a refresh replaces the layer's entry.
_INT8_SCREENS: dict[int, Int8Screen] = {}


def _onednn(device: torch.device):
    """vLLM's ``_custom_ops`` when its oneDNN CPU GEMM is usable for the screen, else None."""
    if os.environ.get("ALOE_VLLM_SCREEN_ONEDNN", "1") == "0" or device.type != "cpu":
        return None
    try:
        from vllm import _custom_ops as vllm_ops
    except Exception:  # no vLLM: plain matmul
        return None
    return vllm_ops if vllm_ops._supports_onednn else None


def screen_buffers(slots: int, addresses: torch.Tensor, kind: str = "bf16") -> dict[str, torch.Tensor]:
    """Fixed-shape buffers of a screened path (``kind``, :func:`screen_kind`) for a layer of ``slots`` slots.

    Both paths have ``aloe_screen_handle`` (0-dim int64): for bf16 the handle of the prepacked
    oneDNN matrix of the live rows (0 = none, screen with ``aloe_addresses_lo``), for int8 the key
    of the layer's int8 screen (:func:`refresh_int8_screen_`). The bf16 path also has
    ``aloe_addresses_lo``: (slots, d) bf16 addresses, and ``aloe_limit_lo``: (slots,) bf16 screen
    limits (+inf for inert slots, which never pass), filled by :func:`refresh_screen_`.
    """
    d, dev = addresses.shape[1], addresses.device
    bufs = {"aloe_screen_handle": torch.zeros((), dtype=torch.int64, device=dev)}
    if kind == "bf16":
        bufs["aloe_addresses_lo"] = torch.zeros((slots, d), dtype=torch.bfloat16, device=dev)
        bufs["aloe_limit_lo"] = torch.full((slots,), float("inf"), dtype=torch.bfloat16, device=dev)
    return bufs


def refresh_screen_(
    addresses_lo: torch.Tensor,
    handle: torch.Tensor,
    limit_lo: torch.Tensor,
    addresses: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    gate_eps: float,
    active: int,
) -> None:
    """Refill the screen buffers in place for the first ``active`` (live) slots; the rest are screened out."""
    limit_lo[:active].copy_(
        screen_limit(addresses[:active].detach(), thresholds[:active].detach(), temperatures[:active].detach(), gate_eps)
    )
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


def screen_kind(n: int, device: torch.device, tp_size: int) -> str | None:
    """Which screened path the TP=1 layer takes: ``"bf16"``, ``"int8"`` or None (the plain path).

    ``ALOE_VLLM_SCREEN``: ``auto`` (default: on CPU, one rank, no Triton interpreter, n >=
    ``ALOE_VLLM_SCREEN_MIN_N`` (default 256): bf16 where the CPU has bf16 dot products, else int8
    where PyTorch has its int8 linear), ``bf16`` or ``1`` and ``int8`` (on CPU whenever possible, for
    tests and benchmarks), ``0`` (never).
    """
    mode = os.environ.get("ALOE_VLLM_SCREEN", "auto").lower()
    if mode in ("0", "off", "false") or device.type != "cpu" or tp_size != 1 or n == 0:
        return None
    if triton_interpreting():
        return None  # the Triton kernel is what is being exercised then
    if mode in ("1", "on", "true", "bf16"):
        return "bf16"
    if mode == "int8":
        if not int8_screen_supported():
            raise RuntimeError("ALOE_VLLM_SCREEN=int8, but this PyTorch has no int8 linear on CPU (fbgemm)")
        return "int8"
    if mode != "auto":
        raise ValueError(f"ALOE_VLLM_SCREEN={mode!r}: use auto, bf16, int8 or 0")
    if n < int(os.environ.get("ALOE_VLLM_SCREEN_MIN_N", str(SCREEN_MIN_EDITS))):
        return None
    if fast_bf16_cpu():
        return "bf16"
    return "int8" if int8_screen_supported() else None


def refresh_int8_screen_(
    handle: torch.Tensor,
    addresses: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    gate_eps: float,
    active: int,
) -> None:
    """Quantise and pack the first ``active`` (live) rows; ``handle`` (0-dim int64) then names the screen."""
    key = handle.data_ptr()
    _INT8_SCREENS[key] = Int8Screen.prepare(addresses[:active], thresholds[:active], temperatures[:active], gate_eps)
    handle.fill_(key)


def int8_screen_of(handle: torch.Tensor) -> Int8Screen:
    """The int8 screen a layer's handle names (:func:`refresh_int8_screen_`)."""
    screen = _INT8_SCREENS.get(int(handle))
    if screen is None:
        raise RuntimeError("no int8 screen is prepared for this layer (refresh_int8_screen_ was not run)")
    return screen
