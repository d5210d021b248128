"""The residual split in two phases for tensor parallelism, with d sharded across ranks.

- Phase A, :func:`partial_scores`: each rank computes ``[h_r A_r^T, |h_r|^2]``
  (T, n+1) fp32 from its slice ``h_r`` of h and the matching address columns
  ``A_r``. The caller sums that buffer over the ranks (all-reduce).
- Phase B, :func:`apply_from_scores_`: every rank normalises the summed scores
  by ``max(sqrt(scores[:, n]), eps)``, gates the columns
  ``[edit_offset, edit_offset + n_share)`` with its own share of the edits and
  adds that share's writes into its (pre-all-reduce) output, so the output
  all-reduce sums ``U g`` exactly once.

Each phase dispatches like :func:`aloe_kernels.aloe_residual_`: the Triton
kernels of :mod:`aloe_kernels.ops.tensor_parallel` where they run (CUDA, or CPU
under ``TRITON_INTERPRET=1``) and the tensors are in kernel dtypes, the
PyTorch functions here otherwise. The PyTorch phase B reads only the write
rows of edits that open for some token (most tokens open none), like
:func:`aloe_kernels.residual.sparse_residual_`.
"""

from __future__ import annotations

import functools

import torch

from .reference import compute_dtype, gates_from_scores, open_score_floor
from .runtime import kernel_dtypes, use_fused_kernel

__all__ = [
    "apply_from_scores_",
    "apply_from_scores_torch_",
    "partial_scores",
    "partial_scores_torch",
]


def partial_scores_torch(h: torch.Tensor, addresses: torch.Tensor) -> torch.Tensor:
    """Phase A in PyTorch: ``[h A^T, |h|^2]`` of shape (T, n+1), fp32 (fp64 for fp64 h)."""
    ct = compute_dtype(h.dtype)
    h2 = h.reshape(-1, h.shape[-1]).to(ct)
    out = torch.empty((h2.shape[0], addresses.shape[0] + 1), device=h.device, dtype=ct)
    torch.matmul(h2, addresses.to(ct).T, out=out[:, :-1])
    out[:, -1] = (h2 * h2).sum(dim=1)
    return out


def apply_from_scores_torch_(
    y: torch.Tensor,
    scores: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float,
    gate_eps: float,
    edit_offset: int = 0,
) -> torch.Tensor:
    """Phase B in PyTorch: gate this rank's share and add its writes into ``y`` (in place)."""
    n_share, d_out = writes.shape
    if n_share == 0 or scores.shape[0] == 0:
        return y
    ct = scores.dtype
    inv_norm = 1.0 / scores[:, -1:].clamp_min(0).sqrt().clamp_min(eps)
    s = scores[:, edit_offset : edit_offset + n_share] * inv_norm
    thr, temp = thresholds.to(ct), temperatures.to(ct)
    open_any = (s > open_score_floor(thr, temp, gate_eps)).any(dim=0)
    idx = open_any.nonzero().squeeze(1)
    if idx.numel() == 0:
        return y
    g = gates_from_scores(s.index_select(1, idx), thr.index_select(0, idx), temp.index_select(0, idx), gate_eps)
    delta = g @ writes.index_select(0, idx).to(ct)
    y.view(-1, d_out).add_(delta.to(y.dtype))
    return y


@functools.cache
def _split_kernels():
    """The Triton split kernels (:mod:`aloe_kernels.ops.tensor_parallel`), imported once.

    Only called where Triton is importable, so a failure here is a broken install (a Triton
    too old for the kernels, say). It raises rather than falling back to PyTorch: the
    fallback reads the open rows with ``nonzero()``, which syncs the host and has a
    data-dependent shape, so under CUDA graph capture it would fail later with an unrelated
    error.
    """
    try:
        from .ops import tensor_parallel
    except Exception as exc:
        import triton

        raise RuntimeError(
            f"ALOE's tensor-parallel Triton kernels do not import with Triton {triton.__version__} "
            f"({type(exc).__name__}: {exc}); install a supported Triton (pyproject.toml) rather than "
            "serving the host-synchronising PyTorch fallback"
        ) from exc
    return tensor_parallel


def _use_kernel(t: torch.Tensor, operand: torch.Tensor) -> bool:
    return use_fused_kernel(t) and kernel_dtypes(t, operand)


def partial_scores(h: torch.Tensor, addresses: torch.Tensor) -> torch.Tensor:
    """Phase A: (T, n+1) fp32 partial scores and partial squared norm of this rank's slice of h."""
    h2 = h.reshape(-1, h.shape[-1])
    if _use_kernel(h2, addresses):
        return _split_kernels().aloe_gate_partial_scores(h2, addresses)
    return partial_scores_torch(h2, addresses).float()


def apply_from_scores_(
    y: torch.Tensor,
    scores: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float,
    gate_eps: float,
    edit_offset: int = 0,
) -> torch.Tensor:
    """Phase B on the all-reduced scores: add this rank's share of ``U g`` into ``y`` (in place)."""
    if _use_kernel(y, writes):
        return _split_kernels().aloe_gate_apply_(y, scores, thresholds, temperatures, writes, eps, gate_eps, edit_offset)
    return apply_from_scores_torch_(y, scores, thresholds, temperatures, writes, eps, gate_eps, edit_offset)
