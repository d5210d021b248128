"""The ALOE residual as torch custom ops, for vLLM's eager and compiled modes.

Three ops, each opaque to torch.compile (fake implementations only describe
shapes), each dispatching to the fused Triton kernel of
``aloe_kernels.ops.aloe_gate`` where it runs (CUDA, or CPU under
``TRITON_INTERPRET=1``) and to PyTorch otherwise:

- ``aloe_vllm::residual_(y, h, A, tau, alpha, U, eps, gate_eps)``: one rank
  (TP=1): ``y += U g(h)`` in place, through :func:`aloe_kernels.aloe_residual_`.
- ``aloe_vllm::partial_scores(h_shard, A_shard) -> (T, n+1) fp32``: tensor
  parallel phase A: raw partial scores ``h_shard A_shard^T`` and the partial
  ``|h_shard|^2`` in the last column. The caller sums it over the TP group.
- ``aloe_vllm::apply_from_scores_(y, scores, tau, alpha, U, eps, gate_eps, edit_offset)``:
  phase B: normalise by ``max(sqrt(scores[:, n]), eps)``, gate the columns
  ``[edit_offset, edit_offset + n_share)`` with this rank's share of the edits
  and add that share's writes into ``y`` (the partial, pre-all-reduce output).

- ``aloe_vllm::screened_residual_(y, h, A_lo, handle, limit_lo, A, tau, alpha, U, eps, gate_eps)``:
  the TP=1 CPU fast path (see :func:`screened_residual_torch_`): scores are
  screened with a bf16 GEMM (AMX/AVX512-BF16) of the normalised h against a
  bf16 copy of the addresses, and only the edits that may open are scored
  again exactly in fp32. The result is the same as the fp32 sparse path (the
  screening margin exceeds the worst-case bf16 error), at a fraction of the
  cost of an fp32 T x n x d GEMM.

The PyTorch phase B reads only the write rows of edits that open for some
token (most tokens open none), like ``aloe_kernels.residual.sparse_residual_``.
"""

from __future__ import annotations

import math
import os
import time

import torch

from aloe_kernels.operator import AloeOperator
from aloe_kernels.reference import compute_dtype, gates_from_scores
from aloe_kernels.residual import aloe_residual_, use_fused_kernel

__all__ = [
    "apply_from_scores_torch_",
    "kernel_split_available",
    "partial_scores_torch",
    "profile_counters",
    "runtime_operator",
    "make_screen_gemm",
    "screen_limit",
    "screened_residual_torch_",
    "screening_enabled",
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


def runtime_operator(addresses, thresholds, temperatures, writes, eps: float, gate_eps: float) -> AloeOperator:
    """An AloeOperator over existing tensors without re-validating them (hot path)."""
    op = object.__new__(AloeOperator)
    op.__dict__.update(
        addresses=addresses, thresholds=thresholds, temperatures=temperatures, writes=writes,
        eps=float(eps), gate_eps=float(gate_eps), edits=None, layer=None, module_path=None,
        base_model=None, weight_fingerprint=None,
    )
    return op


# ----------------------------------------------------------------- PyTorch TP math


def partial_scores_torch(h: torch.Tensor, addresses: torch.Tensor) -> torch.Tensor:
    """Phase A in PyTorch: ``[h A^T, |h|^2]`` of shape (T, n+1), fp32 (fp64 for fp64 h)."""
    ct = compute_dtype(h.dtype)
    h2 = h.reshape(-1, h.shape[-1]).to(ct)
    out = torch.empty((h2.shape[0], addresses.shape[0] + 1), device=h.device, dtype=ct)
    torch.matmul(h2, addresses.to(ct).T, out=out[:, :-1])
    out[:, -1] = (h2 * h2).sum(dim=1)
    return out


def _open_floor(thresholds: torch.Tensor, temperatures: torch.Tensor, gate_eps: float) -> torch.Tensor:
    if gate_eps <= 0:
        return torch.full_like(thresholds, -math.inf)
    return thresholds + math.log(gate_eps / (1.0 - gate_eps)) / temperatures


def apply_from_scores_torch_(
    y: torch.Tensor, scores: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor,
    writes: torch.Tensor, eps: float, gate_eps: float, edit_offset: int = 0,
) -> torch.Tensor:
    """Phase B in PyTorch: gate this rank's share and add its writes into ``y`` (in place)."""
    n_share, d_out = writes.shape
    if n_share == 0 or scores.shape[0] == 0:
        return y
    ct = scores.dtype
    inv_norm = 1.0 / scores[:, -1:].clamp_min(0).sqrt().clamp_min(eps)
    s = scores[:, edit_offset:edit_offset + n_share] * inv_norm
    thr, temp = thresholds.to(ct), temperatures.to(ct)
    open_any = (s > _open_floor(thr, temp, gate_eps)).any(dim=0)
    idx = open_any.nonzero().squeeze(1)
    if idx.numel() == 0:
        return y
    g = gates_from_scores(s.index_select(1, idx), thr.index_select(0, idx), temp.index_select(0, idx), gate_eps)
    delta = g @ writes.index_select(0, idx).to(ct)
    y.view(-1, d_out).add_(delta.to(y.dtype))
    return y


# ----------------------------------------------------------------- screened CPU path (TP=1)

#: Margin (in normalised-score units) by which the bf16 screen undercuts each
#: edit's open floor. Worst case of |bf16 score - exact score| for unit
#: addresses and |h/|h|| = 1: rounding h and the address to bf16 (2 * 2^-9, by
#: Cauchy-Schwarz), fp32 accumulation over d <= 16k (< 1e-3), rounding the
#: output and the limit to bf16 (2^-9 each, |limit| <= ~1.2): < 0.0095.
SCREEN_MARGIN = 0.0125


def screen_limit(thresholds: torch.Tensor, temperatures: torch.Tensor, gate_eps: float) -> torch.Tensor:
    """Per-edit bf16 limit of the screen: open floor minus :data:`SCREEN_MARGIN`."""
    return (_open_floor(thresholds.float(), temperatures.float(), gate_eps) - SCREEN_MARGIN).to(torch.bfloat16)


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


def screened_residual_torch_(
    y: torch.Tensor, h: torch.Tensor, addresses_lo: torch.Tensor, limit_lo: torch.Tensor,
    addresses: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor, writes: torch.Tensor,
    eps: float, gate_eps: float, screen_handle: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y += U g(h)`` (in place): bf16 screen over all edits, exact fp32 gates for the few that may open.

    An edit is kept when its bf16 score exceeds ``limit_lo`` for some token;
    every edit whose exact score reaches its open floor is kept (see
    :data:`SCREEN_MARGIN`), so the gates equal the fp32 path's. The screen
    GEMM uses the prepacked oneDNN handle when given (see
    :func:`make_screen_gemm`), else ``addresses_lo``.
    """
    n, d = addresses.shape
    d_out = writes.shape[1]
    h2 = h.reshape(-1, d)
    if h2.shape[0] == 0 or n == 0:
        return y
    hf = h2.float()
    hn = hf / torch.linalg.vector_norm(hf, dim=1, keepdim=True).clamp_min(eps)
    hb = hn.to(torch.bfloat16)
    if screen_handle is not None and screen_handle.numel():
        raw = torch.empty((hb.shape[0], n), dtype=torch.bfloat16, device=hb.device)
        torch.ops._C.onednn_mm(raw, hb, None, screen_handle)
    else:
        raw = hb @ addresses_lo.T
    best = raw.amax(dim=0)  # (n,): one pass over the bf16 scores
    idx = (best > limit_lo).nonzero().squeeze(1)
    if idx.numel() == 0:
        return y
    s = hn @ addresses.index_select(0, idx).float().T
    g = gates_from_scores(s, thresholds.index_select(0, idx).float(), temperatures.index_select(0, idx).float(),
                          gate_eps)
    y.view(-1, d_out).add_((g @ writes.index_select(0, idx).float()).to(y.dtype))
    return y


def fast_bf16_cpu() -> bool:
    """Whether this CPU has native bf16 dot products (AMX or AVX512-BF16) for the screen."""
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # pragma: no cover - probe unavailable
            pass
    return False


def screening_enabled(n: int, device: torch.device, tp_size: int) -> bool:
    """Whether the TP=1 layer takes the screened CPU path.

    ``ALOE_VLLM_SCREEN``: ``auto`` (default: CPU, one rank, no Triton interpreter,
    fast bf16, n >= ``ALOE_VLLM_SCREEN_MIN_N``, default 256), ``1`` (on CPU
    whenever possible, for tests), ``0`` (never).
    """
    mode = os.environ.get("ALOE_VLLM_SCREEN", "auto").lower()
    if mode in ("0", "off", "false") or device.type != "cpu" or tp_size != 1 or n == 0:
        return False
    from aloe_kernels.residual import triton_interpreting

    if triton_interpreting():
        return False  # the Triton kernel is what is being exercised then
    if mode in ("1", "on", "true"):
        return True
    return fast_bf16_cpu() and n >= int(os.environ.get("ALOE_VLLM_SCREEN_MIN_N", "256"))


# ----------------------------------------------------------------- kernel split (Triton)


def kernel_split_available() -> bool:
    """Whether ``aloe_kernels.ops.aloe_gate`` provides the tensor-parallel split."""
    try:
        from aloe_kernels.ops import aloe_gate  # noqa: F401
    except Exception:  # ImportError without Triton, or a kernel module still being written
        return False
    return hasattr(aloe_gate, "aloe_gate_partial_scores") and hasattr(aloe_gate, "aloe_gate_apply_")


def _use_kernel(t: torch.Tensor) -> bool:
    return use_fused_kernel(t) and t.dtype in (torch.float32, torch.float16, torch.bfloat16) and kernel_split_available()


# ----------------------------------------------------------------- custom ops


@torch.library.custom_op("aloe_vllm::residual_", mutates_args=("y",))
def residual_(
    y: torch.Tensor, h: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor,
    temperatures: torch.Tensor, writes: torch.Tensor, eps: float, gate_eps: float,
) -> None:
    """``y += U g(h)`` through the runtime's dispatch (fused kernel or sparse PyTorch)."""
    with _timed(h.numel() // h.shape[-1]):
        aloe_residual_(y, h, runtime_operator(addresses, thresholds, temperatures, writes, eps, gate_eps))


@residual_.register_fake
def _residual_fake(y, h, addresses, thresholds, temperatures, writes, eps, gate_eps) -> None:
    return None


@torch.library.custom_op("aloe_vllm::screened_residual_", mutates_args=("y",))
def screened_residual_(
    y: torch.Tensor, h: torch.Tensor, addresses_lo: torch.Tensor, screen_handle: torch.Tensor,
    limit_lo: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor,
    writes: torch.Tensor, eps: float, gate_eps: float,
) -> None:
    """``y += U g(h)``: the screened CPU path (:func:`screened_residual_torch_`)."""
    with _timed(h.numel() // h.shape[-1]):
        screened_residual_torch_(y, h, addresses_lo, limit_lo, addresses, thresholds, temperatures, writes,
                                 eps, gate_eps, screen_handle)


@screened_residual_.register_fake
def _screened_fake(y, h, addresses_lo, screen_handle, limit_lo, addresses, thresholds, temperatures, writes, eps,
                   gate_eps) -> None:
    return None


@torch.library.custom_op("aloe_vllm::partial_scores", mutates_args=())
def partial_scores(h: torch.Tensor, addresses: torch.Tensor) -> torch.Tensor:
    """Phase A: (T, n+1) fp32 partial scores and partial squared norm of this rank's slice of h."""
    h2 = h.reshape(-1, h.shape[-1])
    with _timed(h2.shape[0]):
        if _use_kernel(h2) and addresses.dtype in (torch.float32, torch.float16, torch.bfloat16):
            from aloe_kernels.ops.aloe_gate import aloe_gate_partial_scores

            return aloe_gate_partial_scores(h2, addresses)
        return partial_scores_torch(h2, addresses).float()


@partial_scores.register_fake
def _partial_scores_fake(h, addresses):
    return h.new_empty((h.numel() // h.shape[-1], addresses.shape[0] + 1), dtype=torch.float32)


@torch.library.custom_op("aloe_vllm::apply_from_scores_", mutates_args=("y",))
def apply_from_scores_(
    y: torch.Tensor, scores: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor,
    writes: torch.Tensor, eps: float, gate_eps: float, edit_offset: int,
) -> None:
    """Phase B on the all-reduced scores: add this rank's share of ``U g`` into ``y``."""
    with _timed(0):
        if _use_kernel(y) and writes.dtype in (torch.float32, torch.float16, torch.bfloat16):
            from aloe_kernels.ops.aloe_gate import aloe_gate_apply_

            aloe_gate_apply_(y, scores, thresholds, temperatures, writes, eps, gate_eps, edit_offset)
            return
        apply_from_scores_torch_(y, scores, thresholds, temperatures, writes, eps, gate_eps, edit_offset)


@apply_from_scores_.register_fake
def _apply_fake(y, scores, thresholds, temperatures, writes, eps, gate_eps, edit_offset) -> None:
    return None
