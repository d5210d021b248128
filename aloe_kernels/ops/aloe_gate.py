"""The fused ALOE gate kernel: row norm, scores, dead-zone gate and gated write
in one pass, added in place into the down-projection output ``y``.

For each token row ``h`` (length d) and n edits::

    hbar = h / max(|h|_2, eps)
    z    = alpha * (V^T hbar - tau)
    g    = max(sigmoid(z) - gate_eps, 0) / (1 - gate_eps)      (exactly 0 when closed)
    y   += U g                                                  (U^T = writes, n x d_out)

Design
======

Grid and work split
-------------------
The main kernel ``_gate_kernel`` runs on a 2-D grid ``(token tiles, edit
splits)``. Program ``(i, s)`` owns the ``BLOCK_T`` tokens of tile ``i`` and the
contiguous edit range ``[s*E, min((s+1)*E, n))`` (``E`` a multiple of 16, chosen
on the host from the shapes and the SM count only). It

1. computes the fp32 row norms of its token tile (one loop over d; the
   normalisation is applied to the T x BLOCK_N scores, never to a copy of h);
2. for each ``BLOCK_N`` chunk of its edit range: raw scores ``h V_chunk^T``
   (loop over d, ``tl.dot`` with fp32 accumulation), the gates in fp32;
3. **skipping**: if every gate of the (BLOCK_T x BLOCK_N) tile is zero (the
   common case) the chunk's write rows are never read. Otherwise it loops over
   d_out tiles and adds ``g @ U_chunk`` to its target; write rows of edits that
   are closed for every token of the tile are masked out of the load (a
   predicated load moves no memory), so only the open edits' rows are read.
   For decode (few tokens, thousands of edits) the kernel therefore reads the
   addresses (unavoidable: a score is needed per edit) plus a handful of write
   rows.

Targets ("modes", a constexpr), chosen on the host from dtypes/shapes only:

- ``DIRECT`` (fp32 ``y`` and a single edit split, i.e. large T): the program is
  the only writer of its token rows, so it read-modify-writes ``y`` for each
  open chunk in edit order. One launch, deterministic.
- ``ATOMIC`` (fp32 ``y``, several splits, ``deterministic=False``): fp32
  ``tl.atomic_add`` straight into ``y``, rows with no open gate masked out.
  One launch; the fp32 sum order across splits is not fixed.
- ``PARTIAL`` (``deterministic=True`` with several splits, or any bf16/fp16
  ``y``): every program writes its split's fp32 partial sum into a workspace
  ``ws[s, t, :]`` (plain stores, first open chunk stores, later chunks add; no
  zero-fill needed) and a per-(split, token) flag saying whether that row was
  written. A second small kernel ``_reduce_kernel`` (grid over token tiles x
  d_out tiles) sums the flagged partials in the fixed split order 0..S-1 and
  adds the result into ``y`` (one rounding to y's dtype). Two launches, no
  atomics, no memset; bits are identical run to run.

So: one launch for fp32 ``y`` (two in deterministic mode when the edits are
split), two launches for bf16/fp16 ``y``. Rows of ``y`` whose gates are all
closed are never written (y keeps its exact bits). Workspace sizes depend only
on shapes (``PARTIAL`` keeps ``S * T * d_out * 4`` bytes under
``PARTIAL_WS_BUDGET`` by lowering S), there is no ``.item()``, no
``nonzero()``, no host synchronisation: safe under CUDA graphs. The ops are
registered as torch custom ops (``aloe::gate_residual_``,
``aloe::gate_partial_scores``, ``aloe::gate_apply_``) with fake
implementations, so torch.compile treats them as opaque.

Precision: all accumulation is fp32. bf16/fp16 tiles go to ``tl.dot`` in their
own dtype on GPU (the gate tile is rounded to the write dtype for the write
product); fp32 tiles use ``input_precision="ieee"`` (no TF32) because the gate
amplifies score errors by the temperature. Under ``TRITON_INTERPRET=1`` a
constexpr flag casts every tile to fp32 before ``tl.dot`` (the interpreter's
bf16 dot is wrong). Mixed dtypes (h and addresses differ) also take the fp32
cast.

Tensor parallelism (split variant)
----------------------------------
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

Autotuning
----------
On CUDA, non-deterministic calls use ``triton.autotune`` over Hopper-oriented
configurations keyed on (T bucket, n, d, d_out, mode); configurations much
taller than the token count are pruned. Tuning runs once per key (restoring
``y``), so warm up before CUDA-graph capture. Deterministic mode uses a fixed
configuration chosen from the shapes, so its bits do not depend on timing
noise across processes. Under the interpreter there is one configuration
(``INTERPRETER_BLOCKS``) and block sizes can be passed explicitly
(``block_t``, ``block_n``, ``block_d``, ``block_o``) so tests can use small
shapes with ragged tiles.

Strides: h may have any row and column strides (no copy; leading dimensions
are flattened with ``reshape``, which copies only when they cannot be merged).
``y`` must be viewable as (T, d_out) (any strides inside that view).
addresses, writes and the scores buffer may have any strides.

Kernels are created lazily (``triton.jit`` at first use, cached per
interpreter mode), so setting ``TRITON_INTERPRET`` after importing this module
still takes effect (in the same process, compiled and interpreted kernels do
not mix: Triton's own library functions follow the mode at import).

Inference only: no autograd formula is registered, so gradients do not flow
through the added term (train or build with ``aloe_kernels.aloe_reference``).
Rows of extreme magnitude are safe: the fused norm keeps a running scale
(rows of 1e30 normalise correctly). Phase A returns a plain sum of squares, so
there a row must stay below ~1e19 in magnitude.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch

import triton
import triton.language as tl

__all__ = [
    "aloe_gate_residual_",
    "aloe_gate_partial_scores",
    "aloe_gate_apply_",
    "plan_launch",
    "GatePlan",
    "PARTIAL_WS_BUDGET",
    "INTERPRETER_BLOCKS",
]

MODE_DIRECT = 0
MODE_ATOMIC = 1
MODE_PARTIAL = 2
_MODE_NAMES = {MODE_DIRECT: "direct", MODE_ATOMIC: "atomic", MODE_PARTIAL: "partial"}

#: Upper bound (bytes) of the fp32 split workspace of the PARTIAL mode.
PARTIAL_WS_BUDGET = 256 * 1024 * 1024
#: Block sizes used under TRITON_INTERPRET=1 when none are given.
INTERPRETER_BLOCKS = {"block_t": 32, "block_n": 64, "block_d": 128, "block_o": 128}
#: Pretend SM count under the interpreter (programs run one after the other there).
INTERPRETER_SMS = 1
_EDIT_GRAIN = 16  # edit ranges per split are multiples of this
_MAX_GRID_Y = 65535
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# --------------------------------------------------------------------------
# Kernels (plain Python functions, jitted lazily by _kernels()).
# --------------------------------------------------------------------------


def _gate_kernel_src(
    h_ptr, a_ptr, thr_ptr, temp_ptr, w_ptr, out_ptr, flag_ptr,
    T, n, d, d_out, edits_per_split, col_offset, norm_col,
    stride_ht, stride_hd, stride_an, stride_ad, stride_wn, stride_wo,
    stride_os, stride_ot, stride_oo, stride_fs,
    eps, gate_eps, inv_one_minus_geps, t_bucket,
    MODE: tl.constexpr, FROM_SCORES: tl.constexpr, CAST_SCORES: tl.constexpr,
    CAST_WRITES: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    h_rows = h_ptr + offs_t64[:, None] * stride_ht

    # ---- row norms (fp32) -------------------------------------------------
    if FROM_SCORES:
        sumsq = tl.load(h_ptr + offs_t64 * stride_ht + norm_col * stride_hd, mask=t_mask, other=0.0).to(tl.float32)
        inv_norm = 1.0 / tl.maximum(tl.sqrt(sumsq), eps)
    else:
        # Overflow-safe norm: a running scale (max |x| seen, at least 1e-30) and the sum of
        # squares of x / scale, so rows with |x| ~ 1e20 (whose squares overflow fp32) still
        # normalise correctly. The scale only grows, so the rescale ratio is <= 1.
        scale = tl.full((BLOCK_T,), 1e-30, dtype=tl.float32)
        sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
        for k0 in range(0, d, BLOCK_D):
            offs_d = k0 + tl.arange(0, BLOCK_D)
            x = tl.load(h_rows + offs_d[None, :] * stride_hd,
                        mask=t_mask[:, None] & (offs_d[None, :] < d), other=0.0).to(tl.float32)
            new_scale = tl.maximum(scale, tl.max(tl.abs(x), axis=1))
            inv_scale = 1.0 / new_scale
            ratio = scale * inv_scale
            xs = x * inv_scale[:, None]
            sumsq = sumsq * (ratio * ratio) + tl.sum(xs * xs, axis=1)
            scale = new_scale
        inv_norm = 1.0 / tl.maximum(scale * tl.sqrt(sumsq), eps)

    # ---- this program's edit range, in BLOCK_N chunks ----------------------
    e_lo = pid_s * edits_per_split
    e_hi = tl.minimum(e_lo + edits_per_split, n)
    any_open = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for n0 in range(e_lo, e_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < e_hi
        offs_n64 = offs_n.to(tl.int64)
        valid = t_mask[:, None] & n_mask[None, :]
        if FROM_SCORES:
            raw = tl.load(h_rows + (col_offset + offs_n64)[None, :] * stride_hd, mask=valid, other=0.0)
            raw = raw.to(tl.float32)
        else:
            raw = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, d, BLOCK_D):
                offs_d = k0 + tl.arange(0, BLOCK_D)
                d_mask = offs_d < d
                x = tl.load(h_rows + offs_d[None, :] * stride_hd,
                            mask=t_mask[:, None] & d_mask[None, :], other=0.0)
                v = tl.load(a_ptr + offs_n64[None, :] * stride_an + offs_d[:, None] * stride_ad,
                            mask=d_mask[:, None] & n_mask[None, :], other=0.0)
                if CAST_SCORES:
                    x = x.to(tl.float32)
                    v = v.to(tl.float32)
                raw = tl.dot(x, v, raw, input_precision=DOT_PREC)
        tau = tl.load(thr_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        alpha = tl.load(temp_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        # Clamped below so exp(-z) stays finite; sigmoid(-80) is far inside the dead zone anyway.
        z = tl.maximum(alpha[None, :] * (raw * inv_norm[:, None] - tau[None, :]), -80.0)
        g = tl.maximum(tl.sigmoid(z) - gate_eps, 0.0) * inv_one_minus_geps
        g = tl.where(valid, g, 0.0)
        row_open = tl.max(g, axis=1) > 0.0          # (BLOCK_T,)
        col_open = tl.max(g, axis=0) > 0.0          # (BLOCK_N,)
        tile_open = tl.max(row_open.to(tl.int32), axis=0)
        if tile_open > 0:
            # 1 for every row once any chunk of this program has stored the tile (vector: the
            # interpreter rejects a scalar folded into a block mask).
            wrote = tl.zeros((BLOCK_T,), dtype=tl.int32) + tl.max(any_open, axis=0)
            for o0 in range(0, d_out, BLOCK_O):
                offs_o = o0 + tl.arange(0, BLOCK_O)
                o_mask = offs_o < d_out
                # Only the write rows of edits open for some token of the tile are read.
                u = tl.load(w_ptr + offs_n64[:, None] * stride_wn + offs_o[None, :] * stride_wo,
                            mask=col_open[:, None] & o_mask[None, :], other=0.0)
                if CAST_WRITES:
                    part = tl.dot(g, u.to(tl.float32), input_precision=DOT_PREC)
                else:
                    part = tl.dot(g.to(u.dtype), u, input_precision=DOT_PREC)
                o_ptrs = (out_ptr + pid_s.to(tl.int64) * stride_os + offs_t64[:, None] * stride_ot
                          + offs_o[None, :] * stride_oo)
                if MODE == 1:  # ATOMIC
                    tl.atomic_add(o_ptrs, part, mask=row_open[:, None] & o_mask[None, :])
                elif MODE == 0:  # DIRECT: sole writer of these rows, fixed order
                    m = row_open[:, None] & o_mask[None, :]
                    prev = tl.load(o_ptrs, mask=m, other=0.0).to(tl.float32)
                    tl.store(o_ptrs, (prev + part).to(out_ptr.dtype.element_ty), mask=m)
                else:  # PARTIAL: first open chunk stores, later ones add
                    m = t_mask[:, None] & o_mask[None, :]
                    prev = tl.load(o_ptrs, mask=m & (wrote[:, None] > 0), other=0.0)
                    tl.store(o_ptrs, prev + part, mask=m)
            any_open = tl.maximum(any_open, row_open.to(tl.int32))
    if MODE == 2:
        tl.store(flag_ptr + pid_s.to(tl.int64) * stride_fs + offs_t64, any_open, mask=t_mask)


def _reduce_kernel_src(
    ws_ptr, flag_ptr, y_ptr, T, d_out, n_split,
    stride_ws, stride_wt, stride_fs, stride_yt, stride_yo,
    BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_o = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = offs_o < d_out
    acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
    rows = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for s in range(0, n_split):  # fixed order: deterministic
        f = tl.load(flag_ptr + s * stride_fs + offs_t64, mask=t_mask, other=0)
        if tl.max(f, axis=0) > 0:
            m = (f[:, None] > 0) & o_mask[None, :]
            acc += tl.load(ws_ptr + s * stride_ws + offs_t64[:, None] * stride_wt + offs_o[None, :],
                           mask=m, other=0.0)
            rows = tl.maximum(rows, f)
    if tl.max(rows, axis=0) > 0:
        m = (rows[:, None] > 0) & o_mask[None, :]
        y_ptrs = y_ptr + offs_t64[:, None] * stride_yt + offs_o[None, :] * stride_yo
        prev = tl.load(y_ptrs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (prev + acc).to(y_ptr.dtype.element_ty), mask=m)


def _scores_kernel_src(
    h_ptr, a_ptr, out_ptr, T, n, d,
    stride_ht, stride_hd, stride_an, stride_ad, stride_ot, stride_on, t_bucket,
    CAST_SCORES: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n
    offs_n64 = offs_n.to(tl.int64)
    acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_D):
        offs_d = k0 + tl.arange(0, BLOCK_D)
        d_mask = offs_d < d
        x = tl.load(h_ptr + offs_t64[:, None] * stride_ht + offs_d[None, :] * stride_hd,
                    mask=t_mask[:, None] & d_mask[None, :], other=0.0)
        v = tl.load(a_ptr + offs_n64[None, :] * stride_an + offs_d[:, None] * stride_ad,
                    mask=d_mask[:, None] & n_mask[None, :], other=0.0)
        xf = x.to(tl.float32)
        sumsq += tl.sum(xf * xf, axis=1)
        if CAST_SCORES:
            x = xf
            v = v.to(tl.float32)
        acc = tl.dot(x, v, acc, input_precision=DOT_PREC)
    o_rows = out_ptr + offs_t64[:, None] * stride_ot
    tl.store(o_rows + offs_n64[None, :] * stride_on, acc, mask=t_mask[:, None] & n_mask[None, :])
    # The norm column n is written by the first edit block only.
    first = (tl.zeros((BLOCK_T,), dtype=tl.int32) + pid_n) == 0  # vector: the interpreter rejects scalar masks
    tl.store(out_ptr + offs_t64 * stride_ot + n * stride_on, sumsq, mask=t_mask & first)


# --------------------------------------------------------------------------
# Autotuning configurations (CUDA only).
# --------------------------------------------------------------------------


def _gate_configs() -> list:
    cfgs = []
    # decode-like tiles: short token tiles, streaming addresses with wide d blocks
    for bn in (16, 32, 64):
        for bd in (128, 256):
            for stages in (3, 4):
                cfgs.append(triton.Config({"BLOCK_T": 16, "BLOCK_N": bn, "BLOCK_D": bd, "BLOCK_O": 128},
                                          num_warps=4, num_stages=stages))
    for bt in (32, 64):
        for bn in (32, 64):
            cfgs.append(triton.Config({"BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_D": 128, "BLOCK_O": 128},
                                      num_warps=4, num_stages=3))
    # prefill-like tiles
    for bt, bn, w in ((64, 128, 8), (128, 64, 8), (128, 128, 8), (64, 64, 4)):
        for bo in (64, 128):
            cfgs.append(triton.Config({"BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_D": 64, "BLOCK_O": bo},
                                      num_warps=w, num_stages=3))
    return cfgs


def _prune_gate_configs(configs, named_args, **kwargs):
    t_bucket = int(named_args["t_bucket"])
    limit = max(16, t_bucket)
    kept = [c for c in configs if c.kwargs["BLOCK_T"] <= limit]
    if t_bucket >= 256:  # many tokens: skip the decode-only tiles
        kept = [c for c in kept if c.kwargs["BLOCK_T"] >= 64] or kept
    return kept or configs


def _scores_configs() -> list:
    cfgs = []
    for bt, bn, bd, w in ((16, 16, 256, 4), (16, 32, 128, 4), (16, 64, 128, 4), (32, 64, 128, 4),
                          (64, 64, 64, 4), (128, 64, 64, 8), (64, 128, 64, 8), (128, 128, 64, 8)):
        cfgs.append(triton.Config({"BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_D": bd}, num_warps=w, num_stages=3))
    return cfgs


@functools.lru_cache(maxsize=None)
def _kernels(interpret: bool) -> dict:
    """jit the kernels for the current mode (the decorator reads TRITON_INTERPRET)."""
    gate = triton.jit(_gate_kernel_src)
    reduce = triton.jit(_reduce_kernel_src)
    scores = triton.jit(_scores_kernel_src)
    out = {"gate": gate, "reduce": reduce, "scores": scores}
    if not interpret:
        out["gate_tuned"] = triton.autotune(
            configs=_gate_configs(),
            key=["t_bucket", "n", "d", "d_out", "MODE", "FROM_SCORES"],
            prune_configs_by={"early_config_prune": _prune_gate_configs},
            restore_value=["out_ptr"],
        )(gate)
        out["scores_tuned"] = triton.autotune(
            configs=_scores_configs(),
            key=["t_bucket", "n", "d"],
            prune_configs_by={"early_config_prune": _prune_gate_configs},
        )(scores)
    return out


# --------------------------------------------------------------------------
# Host-side planning.
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class GatePlan:
    """How a call is launched: mode, number of edit splits, edits per split, launches."""

    mode: int
    split: int
    edits_per_split: int
    launches: int

    @property
    def mode_name(self) -> str:
        return _MODE_NAMES[self.mode]


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_SMS


def _t_bucket(T: int) -> int:
    return min(1 << max(0, (T - 1).bit_length()), 8192)


def plan_launch(T: int, n: int, d_out: int, y_dtype: torch.dtype, deterministic: bool,
                n_sms: int, split: int = 0) -> GatePlan:
    """Pick mode and edit split from shapes, dtypes and the SM count only (graph safe)."""
    if split <= 0:
        token_tiles = -(-T // 64)
        split = max(1, min(-(-n // _EDIT_GRAIN), -(-4 * n_sms // token_tiles)))
    split = max(1, min(split, n, _MAX_GRID_Y))
    fp32_y = y_dtype == torch.float32
    if fp32_y and split == 1:
        mode = MODE_DIRECT
    elif fp32_y and not deterministic:
        mode = MODE_ATOMIC
    else:
        mode = MODE_PARTIAL
        cap = max(1, PARTIAL_WS_BUDGET // max(1, T * d_out * 4))
        split = min(split, cap)
        if fp32_y and split == 1:
            mode = MODE_DIRECT
    grain = _EDIT_GRAIN if n >= _EDIT_GRAIN * split else 1
    per = -(-n // split)
    per = -(-per // grain) * grain
    split = -(-n // per)
    launches = 2 if mode == MODE_PARTIAL else 1
    return GatePlan(mode=mode, split=split, edits_per_split=per, launches=launches)


def _fixed_blocks(T: int, interpret: bool) -> dict:
    if interpret:
        return dict(INTERPRETER_BLOCKS)
    bt = 16 if T <= 16 else 32 if T <= 32 else 64 if T <= 1024 else 128
    return {"block_t": bt, "block_n": 64, "block_d": 128 if bt <= 64 else 64, "block_o": 128}


def _resolve_blocks(T: int, interpret: bool, block_t: int, block_n: int, block_d: int, block_o: int) -> dict:
    base = _fixed_blocks(T, interpret)
    given = {"block_t": block_t, "block_n": block_n, "block_d": block_d, "block_o": block_o}
    for k, v in given.items():
        if v and v > 0:
            if v & (v - 1):
                raise ValueError(f"{k} must be a power of two, got {v}")
            base[k] = int(v)
    return base


def _meta(blocks: dict) -> dict:
    return {"BLOCK_T": blocks["block_t"], "BLOCK_N": blocks["block_n"],
            "BLOCK_D": blocks["block_d"], "BLOCK_O": blocks["block_o"]}


def _launch_params(blocks: dict, T: int, interpret: bool) -> dict:
    if interpret:
        return {}
    bt = blocks["block_t"]
    return {"num_warps": 8 if bt >= 128 else 4, "num_stages": 3}


# --------------------------------------------------------------------------
# Launch implementations (called by the custom ops).
# --------------------------------------------------------------------------


def _run_gate(y2: torch.Tensor, src: torch.Tensor, addresses: torch.Tensor | None,
              thresholds: torch.Tensor, temperatures: torch.Tensor, writes: torch.Tensor,
              eps: float, gate_eps: float, deterministic: bool, *, from_scores: bool,
              col_offset: int, norm_col: int, d: int, split: int, blocks_given: tuple) -> None:
    """Shared launcher for the fused kernel (from h) and phase B (from scores)."""
    T, d_out = y2.shape
    n = writes.shape[0]
    if T == 0 or n == 0:
        return
    interpret = _interpreting()
    k = _kernels(interpret)
    plan = plan_launch(T, n, d_out, y2.dtype, deterministic, _sm_count(y2.device), split)
    explicit = any(b > 0 for b in blocks_given)
    blocks = _resolve_blocks(T, interpret, *blocks_given)
    a = addresses if addresses is not None else src
    cast_scores = interpret or (not from_scores and src.dtype != a.dtype)
    cast_writes = interpret or writes.dtype == torch.float32
    dot_prec = "ieee"
    if plan.mode == MODE_PARTIAL:
        out = torch.empty((plan.split, T, d_out), device=y2.device, dtype=torch.float32)
        flags = torch.empty((plan.split, T), device=y2.device, dtype=torch.int32)
        so, st, soo, sf = out.stride(0), out.stride(1), out.stride(2), flags.stride(0)
    else:
        out, flags = y2, y2  # flags unused
        so, st, soo, sf = 0, y2.stride(0), y2.stride(1), 0
    args = (
        src, a, thresholds, temperatures, writes, out, flags,
        T, n, d, d_out, plan.edits_per_split, col_offset, norm_col,
        src.stride(0), src.stride(1), a.stride(0), a.stride(1) if a.dim() > 1 else 1,
        writes.stride(0), writes.stride(1),
        so, st, soo, sf,
        float(eps), float(gate_eps), 1.0 / (1.0 - float(gate_eps)), _t_bucket(T),
    )
    consts = {"MODE": plan.mode, "FROM_SCORES": from_scores, "CAST_SCORES": cast_scores,
              "CAST_WRITES": cast_writes, "DOT_PREC": dot_prec}
    use_tuned = (not interpret) and (not deterministic) and (not explicit)
    if use_tuned:
        grid = lambda META: (triton.cdiv(T, META["BLOCK_T"]), plan.split)  # noqa: E731
        k["gate_tuned"][grid](*args, **consts)
    else:
        grid = (triton.cdiv(T, blocks["block_t"]), plan.split)
        k["gate"][grid](*args, **consts, **_meta(blocks), **_launch_params(blocks, T, interpret))
    if plan.mode == MODE_PARTIAL:
        rb_t = min(blocks["block_t"], 64) if interpret or explicit else (16 if T <= 16 else 64)
        rb_o = blocks["block_o"] if interpret or explicit else 128
        rgrid = (triton.cdiv(T, rb_t), triton.cdiv(d_out, rb_o))
        extra = {} if interpret else {"num_warps": 4}
        k["reduce"][rgrid](
            out, flags, y2, T, d_out, plan.split,
            out.stride(0), out.stride(1), flags.stride(0), y2.stride(0), y2.stride(1),
            BLOCK_T=rb_t, BLOCK_O=rb_o, **extra,
        )


def _flat_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    return t.reshape(-1, width) if t.dim() != 2 else t


def _y_rows(y: torch.Tensor, d_out: int) -> torch.Tensor:
    if y.dim() == 2:
        return y
    try:
        return y.view(-1, d_out)
    except RuntimeError as exc:  # pragma: no cover - validated before
        raise ValueError(f"y of shape {tuple(y.shape)} and strides {y.stride()} cannot be viewed as "
                         f"(tokens, {d_out}) in place") from exc


# --------------------------------------------------------------------------
# torch custom ops.
# --------------------------------------------------------------------------


@torch.library.custom_op("aloe::gate_residual_", mutates_args=("y",))
def _gate_residual_op(
    y: torch.Tensor, h: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor,
    temperatures: torch.Tensor, writes: torch.Tensor, eps: float, gate_eps: float,
    deterministic: bool = False, split: int = 0, block_t: int = 0, block_n: int = 0,
    block_d: int = 0, block_o: int = 0,
) -> None:
    d = addresses.shape[1]
    d_out = writes.shape[1]
    y2 = _y_rows(y, d_out)
    h2 = _flat_rows(h, d)
    _run_gate(y2, h2, addresses, thresholds, temperatures, writes, eps, gate_eps, deterministic,
              from_scores=False, col_offset=0, norm_col=0, d=d, split=split,
              blocks_given=(block_t, block_n, block_d, block_o))


@_gate_residual_op.register_fake
def _gate_residual_fake(y, h, addresses, thresholds, temperatures, writes, eps, gate_eps,
                        deterministic=False, split=0, block_t=0, block_n=0, block_d=0, block_o=0) -> None:
    return None


@torch.library.custom_op("aloe::gate_partial_scores", mutates_args=())
def _partial_scores_op(h: torch.Tensor, addresses: torch.Tensor, block_t: int = 0, block_n: int = 0,
                       block_d: int = 0) -> torch.Tensor:
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
    interpret = _interpreting()
    k = _kernels(interpret)
    explicit = block_t > 0 or block_n > 0 or block_d > 0
    blocks = _resolve_blocks(T, interpret, block_t, block_n, block_d, 0)
    args = (h2, addresses, out, T, n, d, h2.stride(0), h2.stride(1), addresses.stride(0), addresses.stride(1),
            out.stride(0), out.stride(1), _t_bucket(T))
    consts = {"CAST_SCORES": interpret or h.dtype != addresses.dtype, "DOT_PREC": "ieee"}
    if not interpret and not explicit:
        grid = lambda META: (triton.cdiv(T, META["BLOCK_T"]), min(triton.cdiv(n, META["BLOCK_N"]), _MAX_GRID_Y))  # noqa: E731
        k["scores_tuned"][grid](*args, **consts)
    else:
        if triton.cdiv(n, blocks["block_n"]) > _MAX_GRID_Y:
            raise ValueError("block_n too small for this many edits")
        grid = (triton.cdiv(T, blocks["block_t"]), triton.cdiv(n, blocks["block_n"]))
        k["scores"][grid](*args, **consts, BLOCK_T=blocks["block_t"], BLOCK_N=blocks["block_n"],
                          BLOCK_D=blocks["block_d"], **_launch_params(blocks, T, interpret))
    return out.view(*lead, n + 1)


@_partial_scores_op.register_fake
def _partial_scores_fake(h, addresses, block_t=0, block_n=0, block_d=0):
    return h.new_empty((*h.shape[:-1], addresses.shape[0] + 1), dtype=torch.float32)


@torch.library.custom_op("aloe::gate_apply_", mutates_args=("y",))
def _gate_apply_op(
    y: torch.Tensor, scores: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor,
    writes: torch.Tensor, eps: float, gate_eps: float, edit_offset: int = 0, deterministic: bool = False,
    split: int = 0, block_t: int = 0, block_n: int = 0, block_o: int = 0,
) -> None:
    d_out = writes.shape[1]
    y2 = _y_rows(y, d_out)
    s2 = _flat_rows(scores, scores.shape[-1])
    _run_gate(y2, s2, None, thresholds, temperatures, writes, eps, gate_eps, deterministic,
              from_scores=True, col_offset=edit_offset, norm_col=scores.shape[-1] - 1, d=0, split=split,
              blocks_given=(block_t, block_n, 0, block_o))


@_gate_apply_op.register_fake
def _gate_apply_fake(y, scores, thresholds, temperatures, writes, eps, gate_eps, edit_offset=0,
                     deterministic=False, split=0, block_t=0, block_n=0, block_o=0) -> None:
    return None


# --------------------------------------------------------------------------
# Public, validating entry points.
# --------------------------------------------------------------------------


def _check_tensor(name: str, t, dtypes=_KERNEL_DTYPES) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        names = ", ".join(str(x).replace("torch.", "") for x in dtypes)
        raise TypeError(f"{name} has dtype {t.dtype}; the fused kernel supports {names}")


def _check_devices(**tensors: torch.Tensor) -> None:
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) != 1:
        desc = ", ".join(f"{k} on {v}" for k, v in devices.items())
        raise ValueError(f"all tensors must be on one device, got {desc}")
    dev = next(iter(devices.values()))
    if dev.type != "cuda" and not _interpreting():
        raise ValueError(f"the fused kernel needs CUDA tensors (or TRITON_INTERPRET=1 on CPU), got {dev}")


def _check_eps(eps: float, gate_eps: float) -> None:
    if not (math.isfinite(float(eps)) and float(eps) > 0):
        raise ValueError(f"eps must be a finite float > 0, got {eps!r}")
    if not (0.0 <= float(gate_eps) < 1.0):
        raise ValueError(f"gate_eps must be in [0, 1), got {gate_eps!r}")


def _check_y(y: torch.Tensor, lead: tuple, d_out: int, what: str) -> None:
    if tuple(y.shape) != tuple(lead) + (d_out,):
        raise ValueError(f"y has shape {tuple(y.shape)}, expected {tuple(lead) + (d_out,)} for {what}")
    if y.dim() >= 2 and y.numel() > 0:
        try:
            y.view(-1, d_out)
        except RuntimeError as exc:
            raise ValueError(f"y (shape {tuple(y.shape)}, strides {y.stride()}) must be viewable as "
                             f"(tokens, {d_out}) so it can be updated in place") from exc


def _check_params(n: int, thresholds: torch.Tensor, temperatures: torch.Tensor, writes: torch.Tensor) -> None:
    for name, t in (("thresholds", thresholds), ("temperatures", temperatures)):
        if tuple(t.shape) != (n,):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected ({n},)")
    if writes.dim() != 2 or writes.shape[0] != n or writes.shape[1] < 1:
        raise ValueError(f"writes has shape {tuple(writes.shape)}, expected ({n}, d_out)")


def aloe_gate_residual_(
    y: torch.Tensor, h: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor,
    temperatures: torch.Tensor, writes: torch.Tensor, eps: float = 1e-6, gate_eps: float = 1e-3,
    deterministic: bool = False, *, split: int = 0, block_t: int = 0, block_n: int = 0,
    block_d: int = 0, block_o: int = 0,
) -> torch.Tensor:
    """Add ``U g(h)`` into ``y`` in place with the fused kernel; returns ``y``.

    ``h``: (..., d), any strides; ``y``: (..., d_out) viewable as (T, d_out);
    ``addresses`` (n, d); ``thresholds``, ``temperatures`` (n,); ``writes``
    (n, d_out). h, addresses, writes, y: float32/bfloat16/float16.
    ``deterministic=True`` gives identical bits run to run (no atomics, fixed
    configuration). ``split`` and ``block_*`` override the launch plan (0 = auto;
    explicit blocks disable autotuning).
    """
    _check_tensor("y", y)
    _check_tensor("h", h)
    _check_tensor("addresses", addresses)
    _check_tensor("writes", writes)
    _check_tensor("thresholds", thresholds, _PARAM_DTYPES)
    _check_tensor("temperatures", temperatures, _PARAM_DTYPES)
    if addresses.dim() != 2:
        raise ValueError(f"addresses has shape {tuple(addresses.shape)}, expected (n, d)")
    n, d = addresses.shape
    if h.dim() < 1 or h.shape[-1] != d:
        raise ValueError(f"h has shape {tuple(h.shape)}, expected (..., {d}) to match addresses (n={n}, d={d})")
    _check_params(n, thresholds, temperatures, writes)
    d_out = writes.shape[1]
    _check_y(y, tuple(h.shape[:-1]), d_out, f"h of shape {tuple(h.shape)}")
    _check_devices(y=y, h=h, addresses=addresses, thresholds=thresholds, temperatures=temperatures, writes=writes)
    _check_eps(eps, gate_eps)
    if h.numel() == 0 or n == 0:
        return y
    torch.ops.aloe.gate_residual_(y, h, addresses, thresholds, temperatures, writes, float(eps), float(gate_eps),
                                  bool(deterministic), int(split), int(block_t), int(block_n), int(block_d),
                                  int(block_o))
    return y


def aloe_gate_partial_scores(h_shard: torch.Tensor, addresses_shard: torch.Tensor, *, block_t: int = 0,
                             block_n: int = 0, block_d: int = 0) -> torch.Tensor:
    """Phase A of the tensor-parallel split: ``(..., n + 1)`` fp32.

    Columns ``[0, n)`` hold the raw partial scores ``h_shard @ addresses_shard^T``
    (not normalised), column ``n`` the partial ``|h_shard|^2``. Sum this buffer
    across ranks (all-reduce), then call :func:`aloe_gate_apply_`.
    """
    _check_tensor("h_shard", h_shard)
    _check_tensor("addresses_shard", addresses_shard)
    if addresses_shard.dim() != 2:
        raise ValueError(f"addresses_shard has shape {tuple(addresses_shard.shape)}, expected (n, d_shard)")
    n, d = addresses_shard.shape
    if h_shard.dim() < 1 or h_shard.shape[-1] != d:
        raise ValueError(f"h_shard has shape {tuple(h_shard.shape)}, expected (..., {d}) to match addresses_shard")
    _check_devices(h_shard=h_shard, addresses_shard=addresses_shard)
    return torch.ops.aloe.gate_partial_scores(h_shard, addresses_shard, int(block_t), int(block_n), int(block_d))


def aloe_gate_apply_(
    y: torch.Tensor, scores: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor,
    writes: torch.Tensor, eps: float = 1e-6, gate_eps: float = 1e-3, edit_offset: int = 0,
    deterministic: bool = False, *, split: int = 0, block_t: int = 0, block_n: int = 0, block_o: int = 0,
) -> torch.Tensor:
    """Phase B of the tensor-parallel split: gate a share of edits and add its writes into ``y``.

    ``scores``: the all-reduced (..., n_total + 1) fp32 buffer of
    :func:`aloe_gate_partial_scores`. ``thresholds``, ``temperatures``
    (n_share,) and ``writes`` (n_share, d_out) describe this rank's share,
    whose scores are the columns ``[edit_offset, edit_offset + n_share)``.
    Returns ``y``.
    """
    _check_tensor("y", y)
    _check_tensor("scores", scores, (torch.float32,))
    _check_tensor("writes", writes)
    _check_tensor("thresholds", thresholds, _PARAM_DTYPES)
    _check_tensor("temperatures", temperatures, _PARAM_DTYPES)
    if scores.dim() < 1 or scores.shape[-1] < 1:
        raise ValueError(f"scores has shape {tuple(scores.shape)}, expected (..., n_total + 1)")
    n_total = scores.shape[-1] - 1
    n = writes.shape[0] if writes.dim() == 2 else -1
    _check_params(n, thresholds, temperatures, writes)
    if edit_offset < 0 or edit_offset + n > n_total:
        raise ValueError(f"edit range [{edit_offset}, {edit_offset + n}) is outside the {n_total} scored edits")
    d_out = writes.shape[1]
    _check_y(y, tuple(scores.shape[:-1]), d_out, f"scores of shape {tuple(scores.shape)}")
    _check_devices(y=y, scores=scores, thresholds=thresholds, temperatures=temperatures, writes=writes)
    _check_eps(eps, gate_eps)
    if scores.numel() == 0 or n == 0:
        return y
    torch.ops.aloe.gate_apply_(y, scores, thresholds, temperatures, writes, float(eps), float(gate_eps),
                               int(edit_offset), bool(deterministic), int(split), int(block_t), int(block_n),
                               int(block_o))
    return y
