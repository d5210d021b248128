"""``aloe_residual_``: add U g(h) into a down-projection output, in place.

Dispatch: the fused Triton kernel on CUDA tensors (and on CPU tensors when
``TRITON_INTERPRET=1``, so that the kernel is testable without a GPU);
otherwise a sparse-aware PyTorch path that reads only the write rows of
edits whose gate is non-zero for some token of the batch.
"""

from __future__ import annotations

import torch

from .operator import AloeOperator
from .reference import _check_input, compute_dtype, open_score_floor
from .runtime import kernel_dtypes, use_fused_kernel


def sparse_residual_(y: torch.Tensor, h: torch.Tensor, op: AloeOperator) -> torch.Tensor:
    """The PyTorch path: dense scores, then only the write rows of open edits.

    Cost model (CPU, decode): the score GEMM reads all n x d addresses and is
    the floor; everything else is kept to O(n) or O(T x d) work:

    - scores are computed edit-major, ``addresses @ hbar^T`` (n, T): MKL runs
      this tall-skinny GEMM markedly faster than ``hbar @ addresses^T``;
    - the inputs are normalised (T x d) when d <= n, else the scores (n x T);
    - an edit is open for some token iff its best score beats the precomputed
      open-score floor (:func:`open_score_floor`): one max over T and one
      compare per edit, no sigmoid over all T x n scores;
    - the sigmoid runs only on the open edits' columns, in place, and only
      their write rows are read (``index_select``); when at least half of the
      edits are open, gathering would cost more than it saves, so the dense
      gates and all write rows are used instead;
    - the write product is accumulated straight into ``y`` with ``addmm_``
      when ``y`` is in the compute dtype and viewable as (T, d_out).
    """
    ct = compute_dtype(h.dtype)
    h2 = h.reshape(-1, op.d)
    T = h2.shape[0]
    if T == 0 or op.n == 0:
        return y
    n = op.n
    hc = _as(h2, ct)
    addresses = _as(op.addresses, ct)
    norm = torch.linalg.vector_norm(hc, dim=1).clamp_min_(op.eps)  # (T,)
    if op.d <= n:
        scores = torch.mm(addresses, (hc / norm.unsqueeze(1)).T)  # (n, T)
    else:
        scores = torch.mm(addresses, hc.T).div_(norm)  # (n, T), scaled per token column
    floor = _as(open_score_floor(op.thresholds, op.temperatures, op.gate_eps), ct)
    best = scores.amax(dim=1) if T > 1 else scores.view(n)
    idx = (best > floor).nonzero().squeeze(1)
    k = idx.numel()
    if k == 0:
        return y
    thresholds = _as(op.thresholds, ct)
    temperatures = _as(op.temperatures, ct)
    if 2 * k >= n:
        gates = _open_gates_(scores, thresholds, temperatures, op.gate_eps)
        writes = _as(op.writes, ct)
    else:
        gates = _open_gates_(
            scores.index_select(0, idx), thresholds.index_select(0, idx), temperatures.index_select(0, idx), op.gate_eps
        )
        writes = _as(op.writes.index_select(0, idx), ct)
    # The 1 / (1 - gate_eps) factor of the gate is applied by the GEMM (alpha).
    _add_product_(y, gates.T, writes, op.d_out, 1.0 / (1.0 - op.gate_eps))
    return y


def _open_gates_(scores: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor, gate_eps: float) -> torch.Tensor:
    """In place on edit-major (k, T) scores: ``max(sigmoid(alpha (s - tau)) - gate_eps, 0)``.

    That is the gate times ``1 - gate_eps``; five in-place passes over the scores.
    """
    z = scores.mul_(temperatures.unsqueeze(1)).sub_((thresholds * temperatures).unsqueeze(1))
    return z.sigmoid_().sub_(gate_eps).clamp_min_(0.0)


def _add_product_(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, d_out: int, alpha: float) -> None:
    """y += alpha * (a @ b), in place, with a: (T, k), b: (k, d_out)."""
    if y.dtype == a.dtype:
        try:
            y2 = y.view(-1, d_out)
        except RuntimeError:
            y2 = None
        if y2 is not None:
            y2.addmm_(a, b, alpha=alpha)
            return
    y.add_(torch.mm(a, b).mul_(alpha).to(y.dtype).view(*y.shape[:-1], d_out))


def _as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def aloe_residual_(y: torch.Tensor, h: torch.Tensor, op: AloeOperator, deterministic: bool = False) -> torch.Tensor:
    """Add ``U g(h)`` into ``y`` in place and return ``y``.

    ``h`` has shape (..., d) (any strides), ``y`` shape (..., d_out) with the
    same leading dimensions. ``deterministic`` asks the fused kernel for
    run-to-run identical bits (the PyTorch path is deterministic anyway).
    """
    _check_input(h, op)
    if y.shape[:-1] != h.shape[:-1] or y.shape[-1] != op.d_out:
        raise ValueError(
            f"y has shape {tuple(y.shape)}, expected {tuple(h.shape[:-1]) + (op.d_out,)} for h of shape {tuple(h.shape)}"
        )
    if op.device != h.device:
        raise ValueError(f"operator is on {op.device} but h is on {h.device}; call op.to(h.device) once")
    # float64 (not a kernel dtype) takes the PyTorch path wherever it runs.
    if use_fused_kernel(h) and kernel_dtypes(y, h, op.addresses, op.writes):
        from .ops.aloe_gate import aloe_gate_residual_

        return aloe_gate_residual_(
            y, h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps, deterministic
        )
    return sparse_residual_(y, h, op)
