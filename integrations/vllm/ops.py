"""The ALOE residual as torch custom ops, for vLLM's eager and compiled modes.

Each op is opaque to torch.compile (fake implementations only describe
shapes) and calls into ``aloe_kernels``, which dispatches to the fused Triton
kernels where they run (CUDA, or CPU under ``TRITON_INTERPRET=1``) and to
PyTorch otherwise:

- ``aloe_vllm::residual_(y, h, A, tau, alpha, U, eps, gate_eps, active=None)``: one rank
  (TP=1): ``y += U g(h)`` in place, through :func:`aloe_kernels.aloe_residual_`.
  ``active`` (a one-element int64 tensor, the layer's live edit count) makes
  the CPU ops skip the inert slots past it (the layer reserves ``capacity``).
- ``aloe_vllm::screened_residual_(y, h, A_lo, handle, limit_lo, A, tau, alpha, U, eps, gate_eps, active=None)``:
  the TP=1 CPU fast path, :func:`aloe_kernels.screened.screened_residual_`
  (a bf16 screen, exact fp32 gates for the edits that may open), whose screen
  GEMM runs on vLLM's prepacked oneDNN handle when there is one
  (:func:`aloe_vllm.screen.refresh_screen_`).
- ``aloe_vllm::int8_screened_residual_(y, h, handle, A, tau, alpha, U, eps, gate_eps, active=None)``:
  the same with the int8 screen of :mod:`aloe_kernels.screened_int8` (CPUs
  without bf16 dot products), prepared for the live rows under ``handle``
  (:func:`aloe_vllm.screen.refresh_int8_screen_`).
- ``aloe_vllm::partial_scores(h_shard, A_shard) -> (T, n+1) fp32``: tensor
  parallel phase A (:func:`aloe_kernels.tensor_parallel.partial_scores`). The
  caller sums it over the TP group.
- ``aloe_vllm::apply_from_scores_(y, scores, tau, alpha, U, eps, gate_eps, edit_offset)``:
  phase B (:func:`aloe_kernels.tensor_parallel.apply_from_scores_`): add this
  rank's share of the writes into ``y`` (the partial, pre-all-reduce output).

With ``ALOE_VLLM_PROFILE=1`` the ops time themselves (:func:`profile_counters`).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

import torch

from aloe_kernels import screened, screened_int8, tensor_parallel
from aloe_kernels.operator import AloeOperator
from aloe_kernels.residual import aloe_residual_

from .screen import int8_screen_of

__all__ = [
    "apply_from_scores_",
    "int8_screened_residual_",
    "partial_scores",
    "profile_counters",
    "residual_",
    "screened_residual_",
]

# Opt-in timing of the ALOE ops in this process (ALOE_VLLM_PROFILE=1), for benchmarks:
# read with profile_counters(), e.g. through LLM.collective_rpc in vLLM workers.
_PROFILE = {"enabled": os.environ.get("ALOE_VLLM_PROFILE", "0") == "1", "seconds": 0.0, "calls": 0, "tokens": 0}


def profile_counters(reset: bool = False) -> dict:
    """Seconds spent in the ALOE ops, calls and tokens since the last reset (ALOE_VLLM_PROFILE=1)."""
    out = {k: _PROFILE[k] for k in ("enabled", "seconds", "calls", "tokens")}
    if reset:
        _PROFILE.update(seconds=0.0, calls=0, tokens=0)
    return out


class _timed:
    def __init__(self, tokens: int):
        self.tokens = tokens

    def __enter__(self):
        self.t = time.perf_counter() if _PROFILE["enabled"] else 0.0

    def __exit__(self, *exc):
        if _PROFILE["enabled"]:
            _PROFILE["seconds"] += time.perf_counter() - self.t
            _PROFILE["calls"] += 1
            _PROFILE["tokens"] += self.tokens


def _onednn_screen(screen_handle: torch.Tensor, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The screen GEMM on vLLM's prepacked oneDNN matrix: (T, d) bf16 -> (T, n) bf16."""

    def gemm(hb: torch.Tensor) -> torch.Tensor:
        raw = torch.empty((hb.shape[0], n), dtype=torch.bfloat16, device=hb.device)
        torch.ops._C.onednn_mm(raw, hb, None, screen_handle)
        return raw

    return gemm


def _live_rows(addresses: torch.Tensor, active: Optional[torch.Tensor]) -> int:
    """How many leading slots hold live edits: ``active`` on CPU, every slot elsewhere.

    Reading the count is free on CPU; on a GPU it would synchronize (and break CUDA graph
    capture), and there the inert slots cost only bandwidth (their gates are exactly 0).
    """
    if active is None or addresses.device.type != "cpu":
        return addresses.shape[0]
    return min(int(active.reshape(-1)[0]), addresses.shape[0])


@torch.library.custom_op("aloe_vllm::residual_", mutates_args=("y",))
def residual_(
    y: torch.Tensor,
    h: torch.Tensor,
    addresses: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float,
    gate_eps: float,
    active: Optional[torch.Tensor] = None,
) -> None:
    """``y += U g(h)`` through the runtime's dispatch (fused kernel or sparse PyTorch)."""
    k = _live_rows(addresses, active)
    if k == 0:
        return
    with _timed(h.numel() // h.shape[-1]):
        # The layer checked these tensors when it loaded them; validating them every forward would
        # cost more than the residual at decode.
        aloe_residual_(y, h, AloeOperator.unchecked(addresses[:k], thresholds[:k], temperatures[:k], writes[:k], eps, gate_eps))


@residual_.register_fake
def _residual_fake(y, h, addresses, thresholds, temperatures, writes, eps, gate_eps, active=None) -> None:
    return None


@torch.library.custom_op("aloe_vllm::screened_residual_", mutates_args=("y",))
def screened_residual_(
    y: torch.Tensor,
    h: torch.Tensor,
    addresses_lo: torch.Tensor,
    screen_handle: torch.Tensor,
    limit_lo: torch.Tensor,
    addresses: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float,
    gate_eps: float,
    active: Optional[torch.Tensor] = None,
) -> None:
    """``y += U g(h)``: the screened CPU path (an empty or zero ``screen_handle`` screens with ``addresses_lo``).

    Only the first ``active`` slots are screened (the packed matrix holds just those).
    """
    k = _live_rows(addresses, active)
    if k == 0:
        return
    with _timed(h.numel() // h.shape[-1]):
        # An empty handle, or 0, means no packed matrix: screen with addresses_lo.
        packed = screen_handle.numel() == 1 and int(screen_handle) != 0
        gemm = _onednn_screen(screen_handle, k) if packed else None
        screened.screened_residual_(
            y, h, addresses_lo[:k], limit_lo[:k], addresses[:k], thresholds[:k], temperatures[:k], writes[:k], eps, gate_eps, gemm
        )


@screened_residual_.register_fake
def _screened_fake(
    y, h, addresses_lo, screen_handle, limit_lo, addresses, thresholds, temperatures, writes, eps, gate_eps, active=None
) -> None:
    return None


@torch.library.custom_op("aloe_vllm::int8_screened_residual_", mutates_args=("y",))
def int8_screened_residual_(
    y: torch.Tensor,
    h: torch.Tensor,
    screen_handle: torch.Tensor,
    addresses: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float,
    gate_eps: float,
    active: Optional[torch.Tensor] = None,
) -> None:
    """``y += U g(h)``: the int8-screened CPU path over the first ``active`` slots (what the screen holds)."""
    k = _live_rows(addresses, active)
    if k == 0:
        return
    with _timed(h.numel() // h.shape[-1]):
        screened_int8.int8_screened_residual_(
            y, h, int8_screen_of(screen_handle), addresses[:k], thresholds[:k], temperatures[:k], writes[:k], eps, gate_eps
        )


@int8_screened_residual_.register_fake
def _int8_screened_fake(y, h, screen_handle, addresses, thresholds, temperatures, writes, eps, gate_eps, active=None) -> None:
    return None


@torch.library.custom_op("aloe_vllm::partial_scores", mutates_args=())
def partial_scores(h: torch.Tensor, addresses: torch.Tensor) -> torch.Tensor:
    """Phase A: (T, n+1) fp32 partial scores and partial squared norm of this rank's slice of h."""
    with _timed(h.numel() // h.shape[-1]):
        return tensor_parallel.partial_scores(h, addresses)


@partial_scores.register_fake
def _partial_scores_fake(h, addresses):
    return h.new_empty((h.numel() // h.shape[-1], addresses.shape[0] + 1), dtype=torch.float32)


@torch.library.custom_op("aloe_vllm::apply_from_scores_", mutates_args=("y",))
def apply_from_scores_(
    y: torch.Tensor,
    scores: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float,
    gate_eps: float,
    edit_offset: int,
) -> None:
    """Phase B on the all-reduced scores: add this rank's share of ``U g`` into ``y``."""
    with _timed(0):
        tensor_parallel.apply_from_scores_(y, scores, thresholds, temperatures, writes, eps, gate_eps, edit_offset)


@apply_from_scores_.register_fake
def _apply_fake(y, scores, thresholds, temperatures, writes, eps, gate_eps, edit_offset) -> None:
    return None
