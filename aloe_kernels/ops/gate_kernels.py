"""The Triton kernels of the ALOE gate: row norm, scores, dead-zone gate and gated write in one pass.

For each token row ``h`` (length d) and n edits::

    hbar = h / max(|h|_2, eps)
    z    = alpha * (V^T hbar - tau)
    g    = max(sigmoid(z) - gate_eps, 0) / (1 - gate_eps)      (exactly 0 when closed)
    y   += U g                                                  (U^T = writes, n x d_out)

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
``PARTIAL_WS_BUDGET`` by lowering S).

Phase B of the tensor-parallel split is ``_gate_kernel`` with
``FROM_SCORES=True`` (same modes, same skipping): the raw scores and the
squared norm are read from the all-reduced scores buffer instead of being
computed from h. Phase A is ``_scores_kernel``.

Precision: all accumulation is fp32. bf16/fp16 tiles go to ``tl.dot`` in their
own dtype on GPU (the gate tile is rounded to the write dtype for the write
product); fp32 tiles use ``input_precision="ieee"`` (no TF32) because the gate
amplifies score errors by the temperature. Under ``TRITON_INTERPRET=1`` a
constexpr flag casts every tile to fp32 before ``tl.dot`` (the interpreter's
bf16 dot is wrong). Mixed dtypes (h and addresses differ) also take the fp32
cast.

Kernels are created lazily (:func:`jit_kernels`, cached per interpreter mode),
so setting ``TRITON_INTERPRET`` after importing this module still takes effect
(in the same process, compiled and interpreted kernels do not mix: Triton's
own library functions follow the mode at import). The functions below are
plain Python until then; ``_gate_kernel`` calls the ``_gate_*`` device
functions, which Triton inlines.
"""

from __future__ import annotations

import functools
import types

import triton
import triton.language as tl

from .launch_plan import gate_configs, prune_gate_configs, scores_configs

__all__ = ["jit_kernels"]


# --------------------------------------------------------------------------
# Device functions of the gate kernel.
# --------------------------------------------------------------------------


def _gate_inv_norms(
    h_ptr, h_rows, offs_t64, t_mask, d, norm_col, stride_ht, stride_hd, eps,
    FROM_SCORES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """1 / max(|h|, eps) per token row of the tile (fp32)."""
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
    return inv_norm


def _gate_raw_scores(
    h_rows, a_ptr, offs_n64, n_mask, t_mask, valid, d, col_offset, stride_hd, stride_an, stride_ad,
    FROM_SCORES: tl.constexpr, CAST_SCORES: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Raw (unnormalised) fp32 scores of the tile's tokens against one chunk of edits."""
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
    return raw


def _gate_values(raw, inv_norm, thr_ptr, temp_ptr, offs_n, n_mask, valid, gate_eps, inv_one_minus_geps):
    """The dead-zone gates of a (tokens, edits) tile of raw scores; 0 outside the valid tile."""
    tau = tl.load(thr_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    alpha = tl.load(temp_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    # Clamped below so exp(-z) stays finite; sigmoid(-80) is far inside the dead zone anyway.
    z = tl.maximum(alpha[None, :] * (raw * inv_norm[:, None] - tau[None, :]), -80.0)
    g = tl.maximum(tl.sigmoid(z) - gate_eps, 0.0) * inv_one_minus_geps
    return tl.where(valid, g, 0.0)


def _gate_add_writes(
    g, w_ptr, out_ptr, offs_n64, offs_t64, t_mask, row_open, col_open, wrote, pid_s, d_out,
    stride_wn, stride_wo, stride_os, stride_ot, stride_oo,
    MODE: tl.constexpr, CAST_WRITES: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """Add ``g @ U_chunk`` to the program's target (see the modes in the module docstring)."""
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


# --------------------------------------------------------------------------
# Kernels.
# --------------------------------------------------------------------------


def _gate_kernel(
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
    inv_norm = _gate_inv_norms(h_ptr, h_rows, offs_t64, t_mask, d, norm_col, stride_ht, stride_hd, eps,
                               FROM_SCORES, BLOCK_T, BLOCK_D)

    # This program's edit range, in BLOCK_N chunks.
    e_lo = pid_s * edits_per_split
    e_hi = tl.minimum(e_lo + edits_per_split, n)
    any_open = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for n0 in range(e_lo, e_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < e_hi
        offs_n64 = offs_n.to(tl.int64)
        valid = t_mask[:, None] & n_mask[None, :]
        raw = _gate_raw_scores(h_rows, a_ptr, offs_n64, n_mask, t_mask, valid, d, col_offset, stride_hd,
                               stride_an, stride_ad, FROM_SCORES, CAST_SCORES, DOT_PREC, BLOCK_T, BLOCK_N, BLOCK_D)
        g = _gate_values(raw, inv_norm, thr_ptr, temp_ptr, offs_n, n_mask, valid, gate_eps, inv_one_minus_geps)
        row_open = tl.max(g, axis=1) > 0.0          # (BLOCK_T,)
        col_open = tl.max(g, axis=0) > 0.0          # (BLOCK_N,)
        tile_open = tl.max(row_open.to(tl.int32), axis=0)
        if tile_open > 0:
            # 1 for every row once any chunk of this program has stored the tile (vector: the
            # interpreter rejects a scalar folded into a block mask).
            wrote = tl.zeros((BLOCK_T,), dtype=tl.int32) + tl.max(any_open, axis=0)
            _gate_add_writes(g, w_ptr, out_ptr, offs_n64, offs_t64, t_mask, row_open, col_open, wrote, pid_s,
                             d_out, stride_wn, stride_wo, stride_os, stride_ot, stride_oo,
                             MODE, CAST_WRITES, DOT_PREC, BLOCK_O)
            any_open = tl.maximum(any_open, row_open.to(tl.int32))
    if MODE == 2:
        tl.store(flag_ptr + pid_s.to(tl.int64) * stride_fs + offs_t64, any_open, mask=t_mask)


def _reduce_kernel(
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


def _scores_kernel(
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
# Lazy jit.
# --------------------------------------------------------------------------

_DEVICE_FUNCTIONS = (_gate_inv_norms, _gate_raw_scores, _gate_values, _gate_add_writes)
_KERNELS = {"gate": _gate_kernel, "reduce": _reduce_kernel, "scores": _scores_kernel}


def _jit_in(namespace: dict, fn: types.FunctionType):
    """``triton.jit`` of a copy of ``fn`` whose globals are ``namespace``."""
    copy = types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__annotations__ = dict(fn.__annotations__)  # Triton reads the constexpr parameters from these
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__doc__ = fn.__doc__
    return triton.jit(copy)


@functools.lru_cache(maxsize=None)
def jit_kernels(interpret: bool) -> dict:
    """jit the kernels for the current mode (``triton.jit`` reads TRITON_INTERPRET when it is called).

    A kernel finds the device functions it calls among its globals, and an
    interpreted kernel can only call interpreted device functions (a compiled
    one only compiled ones). So each mode gets its own copy of this module's
    namespace, in which the device functions and the kernels are jitted
    together; the module itself is left as it is.

    Returns ``gate``, ``reduce``, ``scores`` and, when compiling, the autotuned
    ``gate_tuned`` and ``scores_tuned``.
    """
    namespace = dict(globals())
    for fn in _DEVICE_FUNCTIONS:
        namespace[fn.__name__] = _jit_in(namespace, fn)
    out = {name: _jit_in(namespace, fn) for name, fn in _KERNELS.items()}
    if not interpret:
        out["gate_tuned"] = triton.autotune(
            configs=gate_configs(),
            key=["t_bucket", "n", "d", "d_out", "MODE", "FROM_SCORES"],
            prune_configs_by={"early_config_prune": prune_gate_configs},
            restore_value=["out_ptr"],
        )(out["gate"])
        out["scores_tuned"] = triton.autotune(
            configs=scores_configs(),
            key=["t_bucket", "n", "d"],
            prune_configs_by={"early_config_prune": prune_gate_configs},
        )(out["scores"])
    return out
