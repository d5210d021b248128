"""The fused ALOE gate: ``y += U g(h)`` in place, in one pass over h, with the Triton kernels of
:mod:`aloe_kernels.ops.gate_kernels` (grid, modes, skipping and precision are described there;
launch planning and autotuning in :mod:`aloe_kernels.ops.launch_plan`).

This module launches those kernels (``_run_gate``, shared with phase B of the
tensor-parallel split in :mod:`aloe_kernels.ops.tensor_parallel`) and registers
the single-rank entry point as the torch custom op ``aloe::gate_residual_``,
with a fake implementation, so torch.compile treats it as opaque. There is no
``.item()``, no ``nonzero()``, no host synchronisation: safe under CUDA graphs.

Strides: h may have any row and column strides (no copy; leading dimensions
are flattened with ``reshape``, which copies only when they cannot be merged).
``y`` must be viewable as (T, d_out) (any strides inside that view).
addresses, writes, thresholds, temperatures and the scores buffer may have any
strides. Launches run under the tensors' CUDA device (``torch.cuda.device``).

Inference only: no autograd formula is registered, so gradients do not flow
through the added term (train or build with ``aloe_kernels.aloe_reference``).
Rows of extreme magnitude are safe: the fused norm keeps a running scale
(rows of 1e30 normalise correctly), in the split-K path too (each d slice
stores its scale). The tensor-parallel phase A returns a plain sum of
squares (additive across ranks), so there a row must stay below ~1e19 in
magnitude.
"""

from __future__ import annotations

import torch
import triton

from ..runtime import triton_interpreting
from . import buffers
from .buffers import device_guard
from .checks import PARAM_DTYPES, check_devices, check_eps, check_params, check_tensor, check_y
from .gate_kernels import jit_kernels
from .launch_plan import (
    MODE_PARTIAL,
    block_meta,
    launch_params,
    may_autotune,
    n_bucket,
    plan_launch,
    reduce_blocks,
    resolve_blocks,
    scores_grid,
    sm_count,
    t_bucket,
)
from .stream_gate import STREAM_MAX_TOKENS, decode_kernel, run_stream_gate

__all__ = ["aloe_gate_residual_"]


# --------------------------------------------------------------------------
# Launch (called by the custom ops).
# --------------------------------------------------------------------------


def _run_gate(y2: torch.Tensor, src: torch.Tensor, addresses: torch.Tensor | None,
              thresholds: torch.Tensor, temperatures: torch.Tensor, writes: torch.Tensor,
              eps: float, gate_eps: float, deterministic: bool, *, from_scores: bool,
              col_offset: int, norm_col: int, d: int, split: int, blocks_given: tuple, k_split: int = 0,
              o_split: int = 0) -> None:
    """Shared launcher for the fused kernel (from h) and phase B (from scores).

    From h with a d split in the plan (split-K), phase A scores the d slices
    into a small fp32 buffer first and the gate kernel then reads that buffer.
    """
    T, d_out = y2.shape
    n = writes.shape[0]
    if T == 0 or n == 0:
        return
    if not from_scores and T <= STREAM_MAX_TOKENS and decode_kernel() == "stream":
        bt, bn, bd, bo = blocks_given  # a token tile below T is the split path's: the stream takes one tile
        run_stream_gate(y2, src, addresses, thresholds, temperatures, writes, eps, gate_eps, programs=split,
                        blocks_given=(bt if bt >= T else 0, bn, bd, bo))
        return
    interpret = triton_interpreting()
    k = jit_kernels(interpret)
    plan = plan_launch(T, n, d_out, y2.dtype, deterministic, sm_count(y2.device), split,
                       0 if from_scores else d, k_split, o_split)
    explicit = any(b > 0 for b in blocks_given)
    a = addresses if addresses is not None else src
    # a scores buffer (fp32) is only added up, never multiplied: it does not widen the tiles
    wide = _wide_tiles(writes) if from_scores else _wide_tiles(writes, src, a)
    blocks = resolve_blocks(T, interpret, *blocks_given, wide=wide)
    # fp32 tiles take the fixed fp32 blocks: the autotuning space is sized for 16-bit tiles.
    tuned = not (interpret or deterministic or explicit or wide)
    if tuned:  # Triton's autotune keys, with the dtypes it adds to them
        key = (t_bucket(T), n_bucket(n), d, d_out, plan.mode, from_scores, plan.k_split, plan.d_per_split,
               plan.o_split, *(str(t.dtype) for t in (src, a, writes, y2)))
        tuned = may_autotune(key, y2.device)
    src_strides = (0, src.stride(0), src.stride(1))
    cast_scores = interpret or (not from_scores and src.dtype != a.dtype)
    with device_guard(y2):
        if plan.k_split > 1:
            src = launch_scores(k, src, a, plan.k_split, plan.d_per_split, True, blocks, tuned, interpret)
            src_strides = src.stride()
            a, from_scores, col_offset, norm_col = src, True, 0, n
        out, flags = _gate_target(y2, plan)
        args = (
            src, a, thresholds, temperatures, writes, out, flags,
            T, n, d, d_out, plan.edits_per_split, col_offset, norm_col, plan.k_split, plan.o_per_split,
            *src_strides, a.stride(0), a.stride(1) if a.dim() > 1 else 1,
            thresholds.stride(0), temperatures.stride(0), writes.stride(0), writes.stride(1),
            out.stride(0) if plan.mode == MODE_PARTIAL else 0, out.stride(-2), out.stride(-1),
            flags.stride(0) if plan.mode == MODE_PARTIAL else 0,
            float(eps), float(gate_eps), 1.0 / (1.0 - float(gate_eps)), t_bucket(T), n_bucket(n),
        )
        consts = {"MODE": plan.mode, "FROM_SCORES": from_scores, "SCALED_NORM": plan.k_split > 1,
                  "CAST_SCORES": cast_scores, "CAST_WRITES": interpret or writes.dtype == torch.float32,
                  "DOT_PREC": "ieee", "O_SLICED": plan.o_split > 1}
        if tuned:
            grid = lambda META: (triton.cdiv(T, META["BLOCK_T"]), plan.split, plan.o_split)  # noqa: E731
            k["gate_tuned_ws" if plan.mode == MODE_PARTIAL else "gate_tuned"][grid](*args, **consts)
        else:
            grid = (triton.cdiv(T, blocks["block_t"]), plan.split, plan.o_split)
            k["gate"][grid](*args, **consts, **block_meta(blocks), **launch_params(blocks, T, interpret))
        if plan.mode == MODE_PARTIAL:
            _run_reduce(k["reduce"], out, flags, y2, plan.split, blocks["block_o"] if explicit else 0, interpret)


def _wide_tiles(*tensors) -> bool:
    """Whether a tile that goes through ``tl.dot`` is fp32 (twice the registers of a 16-bit one)."""
    return any(t.element_size() > 2 for t in tensors)


def _gate_target(y2: torch.Tensor, plan) -> tuple:
    """(out, flags) of the gate kernel: y itself, or the fp32 split workspace and its row flags."""
    if plan.mode != MODE_PARTIAL:
        return y2, y2  # flags unused
    T, d_out = y2.shape
    ws = buffers.empty_workspace((plan.split, T, d_out), y2.device, torch.float32)
    return ws, buffers.empty_workspace((plan.split, T), y2.device, torch.int32)


def launch_scores(k: dict, h2: torch.Tensor, addresses: torch.Tensor, k_split: int, d_per_split: int,
                  scaled: bool, blocks: dict, tuned: bool, interpret: bool) -> torch.Tensor:
    """Phase A (``_scores_kernel``): raw scores and norms of each d slice, fp32.

    Returns (T, n + 1) for the tensor-parallel format (one slice, plain sum of
    squares) or, with ``scaled``, (k_split, T, n + 2) for the split-K path.
    """
    T = h2.shape[0]
    n, d = addresses.shape
    out = buffers.empty_workspace((k_split, T, n + 2) if scaled else (T, n + 1), h2.device, torch.float32)
    args = (h2, addresses, out, T, n, d, d_per_split, h2.stride(0), h2.stride(1), addresses.stride(0),
            addresses.stride(1), out.stride(0) if scaled else 0, out.stride(-2), out.stride(-1),
            t_bucket(T), n_bucket(n))
    consts = {"SCALED_NORM": scaled, "CAST_SCORES": interpret or h2.dtype != addresses.dtype, "DOT_PREC": "ieee"}
    if tuned:
        grid = lambda META: scores_grid(T, n, k_split, META["BLOCK_T"], META["BLOCK_N"])  # noqa: E731
        k["scores_tuned"][grid](*args, **consts)
    else:
        grid = scores_grid(T, n, k_split, blocks["block_t"], blocks["block_n"])
        k["scores"][grid](*args, **consts, BLOCK_T=blocks["block_t"], BLOCK_N=blocks["block_n"],
                          BLOCK_D=blocks["block_d"], **launch_params(blocks, T, interpret))
    return out


def _run_reduce(kernel, ws: torch.Tensor, flags: torch.Tensor, y2: torch.Tensor, n_split: int, block_o: int,
                interpret: bool) -> None:
    """Second launch of the PARTIAL mode: sum the split partials in fixed order into ``y``."""
    T, d_out = y2.shape
    rb = reduce_blocks(T, n_split, d_out, block_o)
    rgrid = (triton.cdiv(T, rb["BLOCK_T"]), triton.cdiv(d_out, rb["BLOCK_O"]))
    extra = {} if interpret else {"num_warps": 4}
    kernel[rgrid](
        ws, flags, y2, T, d_out, n_split,
        ws.stride(0), ws.stride(1), flags.stride(0), y2.stride(0), y2.stride(1),
        **rb, **extra,
    )


def _flat_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` as (rows, width): leading dimensions merged (a copy only when they cannot be)."""
    return t.reshape(-1, width) if t.dim() != 2 else t


def _y_rows(y: torch.Tensor, d_out: int) -> torch.Tensor:
    """``y`` viewed as (tokens, d_out), never copied: the kernels write into it."""
    if y.dim() == 2:
        return y
    try:
        return y.view(-1, d_out)
    except RuntimeError as exc:  # pragma: no cover - validated before
        raise ValueError(f"y of shape {tuple(y.shape)} and strides {y.stride()} cannot be viewed as "
                         f"(tokens, {d_out}) in place") from exc


# --------------------------------------------------------------------------
# torch custom op.
# --------------------------------------------------------------------------


@torch.library.custom_op("aloe::gate_residual_", mutates_args=("y",))
def _gate_residual_op(
    y: torch.Tensor, h: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor,
    temperatures: torch.Tensor, writes: torch.Tensor, eps: float, gate_eps: float,
    deterministic: bool = False, split: int = 0, block_t: int = 0, block_n: int = 0,
    block_d: int = 0, block_o: int = 0, k_split: int = 0, o_split: int = 0,
) -> None:
    d = addresses.shape[1]
    d_out = writes.shape[1]
    y2 = _y_rows(y, d_out)
    h2 = _flat_rows(h, d)
    _run_gate(y2, h2, addresses, thresholds, temperatures, writes, eps, gate_eps, deterministic,
              from_scores=False, col_offset=0, norm_col=0, d=d, split=split,
              blocks_given=(block_t, block_n, block_d, block_o), k_split=k_split, o_split=o_split)


@_gate_residual_op.register_fake
def _gate_residual_fake(y, h, addresses, thresholds, temperatures, writes, eps, gate_eps,
                        deterministic=False, split=0, block_t=0, block_n=0, block_d=0, block_o=0,
                        k_split=0, o_split=0) -> None:
    return None


# --------------------------------------------------------------------------
# Public, validating entry point.
# --------------------------------------------------------------------------


def aloe_gate_residual_(
    y: torch.Tensor, h: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor,
    temperatures: torch.Tensor, writes: torch.Tensor, eps: float = 1e-6, gate_eps: float = 1e-3,
    deterministic: bool = False, *, split: int = 0, block_t: int = 0, block_n: int = 0,
    block_d: int = 0, block_o: int = 0, k_split: int = 0, o_split: int = 0,
) -> torch.Tensor:
    """Add ``U g(h)`` into ``y`` in place with the fused kernel; returns ``y``.

    ``h``: (..., d), any strides; ``y``: (..., d_out) viewable as (T, d_out);
    ``addresses`` (n, d); ``thresholds``, ``temperatures`` (n,); ``writes``
    (n, d_out). h, addresses, writes, y: float32/bfloat16/float16.
    ``deterministic=True`` gives identical bits run to run (no atomics, fixed
    configuration). ``split`` (edit ranges), ``k_split`` (d slices: phase A
    scores them, then the gate reads the summed scores), ``o_split`` (d_out
    slices written by separate programs, only where the gate reads scores)
    and ``block_*`` override the launch plan (0 = auto; explicit blocks
    disable autotuning). With ``ALOE_DECODE_KERNEL=stream``, calls of at most 32 tokens take
    the streaming decode kernels (:mod:`aloe_kernels.ops.stream_gate`; ``split`` is then
    their number of persistent programs).
    """
    check_tensor("y", y)
    check_tensor("h", h)
    check_tensor("addresses", addresses)
    check_tensor("writes", writes)
    check_tensor("thresholds", thresholds, PARAM_DTYPES)
    check_tensor("temperatures", temperatures, PARAM_DTYPES)
    if addresses.dim() != 2:
        raise ValueError(f"addresses has shape {tuple(addresses.shape)}, expected (n, d)")
    n, d = addresses.shape
    if h.dim() < 1 or h.shape[-1] != d:
        raise ValueError(f"h has shape {tuple(h.shape)}, expected (..., {d}) to match addresses (n={n}, d={d})")
    check_params(n, thresholds, temperatures, writes)
    d_out = writes.shape[1]
    check_y(y, tuple(h.shape[:-1]), d_out, f"h of shape {tuple(h.shape)}")
    check_devices(y=y, h=h, addresses=addresses, thresholds=thresholds, temperatures=temperatures, writes=writes)
    check_eps(eps, gate_eps)
    if h.numel() == 0 or n == 0:
        return y
    torch.ops.aloe.gate_residual_(y, h, addresses, thresholds, temperatures, writes, float(eps), float(gate_eps),
                                  bool(deterministic), int(split), int(block_t), int(block_n), int(block_d),
                                  int(block_o), int(k_split), int(o_split))
    return y
