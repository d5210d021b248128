"""The fused gate split in two phases for tensor parallelism (d sharded across ranks).

- Phase A, ``aloe_gate_partial_scores(h_shard, addresses_shard) -> (..., n+1)``
  fp32: raw partial scores ``V_shard^T h_shard`` and the partial ``|h_shard|^2``
  in the last column (``_scores_kernel``).
- The caller all-reduces (sums) that buffer across ranks.
- Phase B, ``aloe_gate_apply_(y, scores, thresholds, temperatures, writes,
  eps, gate_eps, edit_offset=0, deterministic=False)``: normalises by
  ``max(sqrt(scores[..., -1]), eps)``, gates the columns
  ``[edit_offset, edit_offset + n_share)`` with the share's thresholds,
  temperatures and writes (n_share rows each), and adds that share's
  ``U g`` into ``y``. Each rank applies a disjoint share so the existing
  output all-reduce sums ``U g`` exactly once. Phase B is ``_gate_kernel``
  with ``FROM_SCORES=True`` (same modes, same skipping).

Both are torch custom ops (``aloe::gate_partial_scores``, ``aloe::gate_apply_``)
with fake implementations, so torch.compile treats them as opaque. The PyTorch
version of the same math is :mod:`aloe_kernels.tensor_parallel`.
"""

from __future__ import annotations

import torch

from ..runtime import triton_interpreting
from .aloe_gate import _flat_rows, _run_gate, _wide_tiles, _y_rows, launch_scores
from .buffers import device_guard
from .checks import PARAM_DTYPES, check_devices, check_eps, check_params, check_tensor, check_y
from .gate_kernels import jit_kernels
from .launch_plan import may_autotune, n_bucket, resolve_blocks, t_bucket

__all__ = ["aloe_gate_apply_", "aloe_gate_partial_scores"]


# --------------------------------------------------------------------------
# torch custom ops.
# --------------------------------------------------------------------------


@torch.library.custom_op("aloe::gate_partial_scores", mutates_args=())
def _partial_scores_op(
    h: torch.Tensor, addresses: torch.Tensor, block_t: int = 0, block_n: int = 0, block_d: int = 0
) -> torch.Tensor:
    n, d = addresses.shape
    lead = h.shape[:-1]
    h2 = _flat_rows(h, d)
    T = h2.shape[0]
    out = torch.empty((T, n + 1), device=h.device, dtype=torch.float32)
    if T == 0:
        return out.view(*lead, n + 1)
    if n == 0:
        out.copy_(h2.float().pow(2).sum(dim=1, keepdim=True))
        return out.view(*lead, n + 1)
    interpret = triton_interpreting()
    explicit = block_t > 0 or block_n > 0 or block_d > 0
    wide = _wide_tiles(h2, addresses)
    blocks = resolve_blocks(T, interpret, block_t, block_n, block_d, 0, wide=wide)
    tuned = not (interpret or explicit or wide) and may_autotune(
        ("scores", t_bucket(T), n_bucket(n), d, str(h2.dtype), str(addresses.dtype)), h2.device
    )
    with device_guard(h2):
        out = launch_scores(jit_kernels(interpret), h2, addresses, 1, d, False, blocks, tuned, interpret)
    return out.view(*lead, n + 1)


@_partial_scores_op.register_fake
def _partial_scores_fake(h, addresses, block_t=0, block_n=0, block_d=0):
    return h.new_empty((*h.shape[:-1], addresses.shape[0] + 1), dtype=torch.float32)


@torch.library.custom_op("aloe::gate_apply_", mutates_args=("y",))
def _gate_apply_op(
    y: torch.Tensor,
    scores: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float,
    gate_eps: float,
    edit_offset: int = 0,
    deterministic: bool = False,
    split: int = 0,
    block_t: int = 0,
    block_n: int = 0,
    block_o: int = 0,
) -> None:
    d_out = writes.shape[1]
    y2 = _y_rows(y, d_out)
    s2 = _flat_rows(scores, scores.shape[-1])
    _run_gate(
        y2,
        s2,
        None,
        thresholds,
        temperatures,
        writes,
        eps,
        gate_eps,
        deterministic,
        from_scores=True,
        col_offset=edit_offset,
        norm_col=scores.shape[-1] - 1,
        d=0,
        split=split,
        blocks_given=(block_t, block_n, 0, block_o),
    )


@_gate_apply_op.register_fake
def _gate_apply_fake(
    y,
    scores,
    thresholds,
    temperatures,
    writes,
    eps,
    gate_eps,
    edit_offset=0,
    deterministic=False,
    split=0,
    block_t=0,
    block_n=0,
    block_o=0,
) -> None:
    return None


# --------------------------------------------------------------------------
# Public, validating entry points.
# --------------------------------------------------------------------------


def aloe_gate_partial_scores(
    h_shard: torch.Tensor, addresses_shard: torch.Tensor, *, block_t: int = 0, block_n: int = 0, block_d: int = 0
) -> torch.Tensor:
    """Phase A of the tensor-parallel split: ``(..., n + 1)`` fp32.

    Columns ``[0, n)`` hold the raw partial scores ``h_shard @ addresses_shard^T``
    (not normalised), column ``n`` the partial ``|h_shard|^2``. Sum this buffer
    across ranks (all-reduce), then call :func:`aloe_gate_apply_`.
    """
    check_tensor("h_shard", h_shard)
    check_tensor("addresses_shard", addresses_shard)
    if addresses_shard.dim() != 2:
        raise ValueError(f"addresses_shard has shape {tuple(addresses_shard.shape)}, expected (n, d_shard)")
    n, d = addresses_shard.shape
    if h_shard.dim() < 1 or h_shard.shape[-1] != d:
        raise ValueError(f"h_shard has shape {tuple(h_shard.shape)}, expected (..., {d}) to match addresses_shard")
    check_devices(h_shard=h_shard, addresses_shard=addresses_shard)
    return torch.ops.aloe.gate_partial_scores(h_shard, addresses_shard, int(block_t), int(block_n), int(block_d))


def aloe_gate_apply_(
    y: torch.Tensor,
    scores: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float = 1e-6,
    gate_eps: float = 1e-3,
    edit_offset: int = 0,
    deterministic: bool = False,
    *,
    split: int = 0,
    block_t: int = 0,
    block_n: int = 0,
    block_o: int = 0,
) -> torch.Tensor:
    """Phase B of the tensor-parallel split: gate a share of edits and add its writes into ``y``.

    ``scores``: the all-reduced (..., n_total + 1) fp32 buffer of
    :func:`aloe_gate_partial_scores`. ``thresholds``, ``temperatures``
    (n_share,) and ``writes`` (n_share, d_out) describe this rank's share,
    whose scores are the columns ``[edit_offset, edit_offset + n_share)``.
    Returns ``y``.
    """
    check_tensor("y", y)
    check_tensor("scores", scores, (torch.float32,))
    check_tensor("writes", writes)
    check_tensor("thresholds", thresholds, PARAM_DTYPES)
    check_tensor("temperatures", temperatures, PARAM_DTYPES)
    if scores.dim() < 1 or scores.shape[-1] < 1:
        raise ValueError(f"scores has shape {tuple(scores.shape)}, expected (..., n_total + 1)")
    n_total = scores.shape[-1] - 1
    n = writes.shape[0] if writes.dim() == 2 else -1
    check_params(n, thresholds, temperatures, writes)
    if edit_offset < 0 or edit_offset + n > n_total:
        raise ValueError(f"edit range [{edit_offset}, {edit_offset + n}) is outside the {n_total} scored edits")
    d_out = writes.shape[1]
    check_y(y, tuple(scores.shape[:-1]), d_out, f"scores of shape {tuple(scores.shape)}")
    check_devices(y=y, scores=scores, thresholds=thresholds, temperatures=temperatures, writes=writes)
    check_eps(eps, gate_eps)
    if scores.numel() == 0 or n == 0:
        return y
    torch.ops.aloe.gate_apply_(
        y,
        scores,
        thresholds,
        temperatures,
        writes,
        float(eps),
        float(gate_eps),
        int(edit_offset),
        bool(deterministic),
        int(split),
        int(block_t),
        int(block_n),
        int(block_o),
    )
    return y
