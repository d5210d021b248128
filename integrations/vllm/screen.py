"""When the TP=1 layer takes the screened CPU path, and its screen GEMM operand on vLLM's CPU backend.

The math of the path is :mod:`aloe_kernels.screened`; this module holds what
depends on vLLM (its oneDNN GEMM) and on the plugin's settings:

- ``ALOE_VLLM_SCREEN``: ``auto`` (default), ``1`` or ``0`` (see :func:`screening_enabled`);
- ``ALOE_VLLM_SCREEN_MIN_N``: the smallest operator screened in ``auto`` mode (default 256);
- ``ALOE_VLLM_SCREEN_ONEDNN``: ``0`` screens with ``torch.matmul`` instead of
  vLLM's prepacked oneDNN GEMM.
"""

from __future__ import annotations

import os

import torch

from aloe_kernels.runtime import triton_interpreting
from aloe_kernels.screened import fast_bf16_cpu

__all__ = ["make_screen_gemm", "screening_enabled"]

_SCREEN_HANDLERS: list = []


def make_screen_gemm(addresses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The screen's bf16 GEMM operand: ``(addresses_lo, handle)``.

    With vLLM's oneDNN CPU GEMM available (``vllm._custom_ops.create_onednn_mm``,
    what vLLM uses for its own linear layers) the bf16 addresses are prepacked
    once and ``handle`` is the int64 handle tensor (``addresses_lo`` is then
    empty: the packed copy is all that is kept); otherwise ``handle`` is empty
    and ``addresses_lo`` is the (n, d) bf16 copy for ``torch.matmul``.
    """
    a_lo = addresses.detach().to(torch.bfloat16).contiguous()
    empty = torch.empty(0, dtype=torch.int64, device=addresses.device)
    if os.environ.get("ALOE_VLLM_SCREEN_ONEDNN", "1") != "0" and a_lo.device.type == "cpu" and a_lo.shape[0] > 0:
        try:
            from vllm import _custom_ops as vllm_ops

            if vllm_ops._supports_onednn:
                handler = vllm_ops.create_onednn_mm(a_lo.t(), 32)
                # The handler frees the packed matrix when collected: keep it for the process's life.
                _SCREEN_HANDLERS.append(handler)
                return a_lo.new_empty((0, a_lo.shape[1])), handler.handler_tensor
        except Exception:  # no vLLM / no oneDNN build: plain matmul
            pass
    return a_lo, empty


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
