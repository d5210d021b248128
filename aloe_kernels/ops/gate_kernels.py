"""The Triton kernels of the ALOE gate: row norm, scores, dead-zone gate and gated write in one pass.

For each token row ``h`` (length d) and n edits::

    hbar = h / max(|h|_2, eps)
    z    = alpha * (V^T hbar - tau)
    g    = max(sigmoid(z) - gate_eps, 0) / (1 - gate_eps)      (exactly 0 when closed)
    y   += U g                                                  (U^T = writes, n x d_out)

Grid and work split
-------------------
The main kernel ``_gate_kernel`` runs on a grid ``(token tiles, edit
splits, d_out slices)``. Program ``(i, s)`` owns the ``BLOCK_T`` tokens of tile ``i`` and the
contiguous edit range ``[s*E, min((s+1)*E, n))`` (``E`` a multiple of 16, chosen
on the host from the shapes and the SM count only). It

1. computes the raw scores ``h V_chunk^T`` of its first ``BLOCK_N`` chunk
   (loop over d, ``tl.dot`` with fp32 accumulation) and, in the same loop
   where the h tile is already loaded, the fp32 row norms (overflow safe: a
   running max-scale, rows of 1e30 normalise correctly). There is no separate
   pass over h before the first address is read; the normalisation is applied
   to the T x BLOCK_N score tile, never to a copy of h;
2. for each chunk of its edit range: the gates in fp32, then the next chunk's
   raw scores (after the last chunk its d range is empty and nothing is read);
3. **skipping**: if every gate of the (BLOCK_T x BLOCK_N) tile is zero (the
   common case) the chunk's write rows are never read. Otherwise it loops over
   d_out tiles and adds ``g @ U_chunk`` to its target; write rows of edits that
   are closed for every token of the tile are masked out of the load (a
   predicated load moves no memory), so only the open edits' rows are read.
   For decode (few tokens, thousands of edits) the kernel therefore reads the
   addresses (unavoidable: a score is needed per edit) plus a handful of write
   rows.

Split-K (few tokens and few edits, e.g. decode with ~1,000 edits): the edit
blocks alone would leave SMs idle, so d is split too. Phase A
(``_scores_kernel``, grid token tiles x edit blocks x d slices) writes each
slice's raw scores and its norm as (scale, scaled sum of squares) into a small
fp32 buffer ``(k_split, T, n + 2)``; the gate kernel then runs with
``FROM_SCORES=True, SCALED_NORM=True`` and sums the slices in slice order (the
gate is nonlinear in the full score, so it needs the whole dot product). One
more launch, no atomics, deterministic.

Write slices: a gate that reads scores (split-K, or phase B of the tensor-parallel
split) has little to do besides the writes, and at decode one program owns the
one open edit and would walk all of d_out alone (on an H100 at T = 1, n = 1,301:
18.6 us of a 63 us call). So its grid has a third axis of d_out slices
(``o_per_split`` columns each): every program of an edit range computes the
same gates from the small buffer and writes only its slice. Reading h, the gate
kernel keeps one slice (the scores would be recomputed per slice).

Targets ("modes", a constexpr), chosen on the host from dtypes/shapes only:

- ``DIRECT`` (fp32 ``y`` and a single edit split, i.e. large T): the program is
  the only writer of its token rows, so it read-modify-writes ``y`` for each
  open chunk in edit order. One launch, deterministic.
- ``ATOMIC`` (fp32 ``y``, several splits, ``deterministic=False``): relaxed
  fp32 ``tl.atomic_add`` straight into ``y``, rows with no open gate masked
  out. One launch; the fp32 sum order across splits is not fixed.
- ``PARTIAL`` (``deterministic=True`` with several splits, or any bf16/fp16
  ``y``): every program writes its split's fp32 partial sum into a workspace
  ``ws[s, t, :]`` (plain stores, first open chunk stores, later chunks add; no
  zero-fill needed) and a per-(split, token) flag saying whether that row was
  written. A second small kernel ``_reduce_kernel`` (grid over token tiles x
  d_out tiles) sums the flagged partials up to 32 splits per step (one masked
  tile load and a ``tl.sum``; steps in split order, a fixed reduction tree)
  and adds the result into ``y`` (one rounding to y's dtype). Two launches, no
  atomics, no memset; bits are identical run to run.

So: one launch for fp32 ``y`` (two in deterministic mode when the edits are
split), two launches for bf16/fp16 ``y``, one more with split-K. Rows of ``y``
whose gates are all closed are never written (y keeps its exact bits).
Workspace sizes depend only on shapes (``PARTIAL`` keeps ``S * T * d_out * 4``
bytes under ``PARTIAL_WS_BUDGET`` by lowering S).

Phase B of the tensor-parallel split is ``_gate_kernel`` with
``FROM_SCORES=True`` (same modes, same skipping): the raw scores and the
squared norm are read from the all-reduced scores buffer instead of being
computed from h. Its phase A is ``_scores_kernel`` with one d slice and the
plain (additive) sum of squares. ``_scores_kernel`` visits edit blocks
grid-stride, so capping its grid (CUDA's 65,535 on axis 1) drops no edit.

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


def _chunk_scores(
    h_rows, a_ptr, offs_n64, n_mask, t_mask, valid, k_lo, k_hi, n_kslices, col_offset,
    stride_hk, stride_hd, stride_an, stride_ad,
    FROM_SCORES: tl.constexpr, WITH_NORM: tl.constexpr, CAST_SCORES: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Raw (unnormalised) fp32 scores of the tile's tokens against one chunk of edits.

    From h: ``h[:, k_lo:k_hi] V_chunk[:, k_lo:k_hi]^T`` (an empty range gives
    zeros without reading anything). With ``WITH_NORM`` the same loop, where
    the h tile is already loaded, also accumulates the overflow-safe row norm:
    a running scale (max |x| seen, at least 1e-30) and the sum of squares of
    ``x / scale``, so rows of 1e30 (whose squares overflow fp32) stay exact;
    the scale only grows, so the rescale ratio is <= 1. Returns
    ``(raw, scale, scaled_sumsq)`` (the last two meaningless without WITH_NORM).
    From scores: the sum, in slice order, of the ``n_kslices`` partial score
    slices of the buffer (``h_rows`` points into it).
    """
    raw = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
    scale = tl.full((BLOCK_T,), 1e-30, dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    if FROM_SCORES:
        cols = (col_offset + offs_n64)[None, :] * stride_hd
        for ks in range(0, n_kslices):  # fixed order: deterministic
            raw += tl.load(h_rows + ks * stride_hk + cols, mask=valid, other=0.0).to(tl.float32)
    else:
        for k0 in range(k_lo, k_hi, BLOCK_D):
            offs_d = k0 + tl.arange(0, BLOCK_D)
            d_mask = offs_d < k_hi
            x = tl.load(h_rows + offs_d[None, :] * stride_hd,
                        mask=t_mask[:, None] & d_mask[None, :], other=0.0)
            v = tl.load(a_ptr + offs_n64[None, :] * stride_an + offs_d[:, None] * stride_ad,
                        mask=d_mask[:, None] & n_mask[None, :], other=0.0)
            if WITH_NORM:
                xf = x.to(tl.float32)
                new_scale = tl.maximum(scale, tl.max(tl.abs(xf), axis=1))
                inv_scale = 1.0 / new_scale
                ratio = scale * inv_scale
                xs = xf * inv_scale[:, None]
                sumsq = sumsq * (ratio * ratio) + tl.sum(xs * xs, axis=1)
                scale = new_scale
            if CAST_SCORES:
                x = x.to(tl.float32)
                v = v.to(tl.float32)
            raw = tl.dot(x, v, raw, input_precision=DOT_PREC)
    return raw, scale, sumsq


def _buffer_inv_norms(
    s_ptr, offs_t64, t_mask, n_kslices, norm_col, stride_hk, stride_ht, stride_hd, eps,
    SCALED_NORM: tl.constexpr, BLOCK_T: tl.constexpr,
):
    """1 / max(|h|, eps) per token row from the norm column(s) of a scores buffer.

    Plain: column ``norm_col`` of each slice holds a sum of squares (the
    tensor-parallel format, additive across ranks). Scaled (the split-K
    buffer): columns ``norm_col`` and ``norm_col + 1`` hold a slice's scale and
    scaled sum of squares, merged here in slice order with the same running
    rescale as :func:`_chunk_scores`, so huge rows do not overflow.
    """
    rows = s_ptr + offs_t64 * stride_ht + norm_col * stride_hd
    scale = tl.full((BLOCK_T,), 1e-30, dtype=tl.float32)
    sumsq = tl.zeros((BLOCK_T,), dtype=tl.float32)
    for ks in range(0, n_kslices):
        if SCALED_NORM:
            s_k = tl.load(rows + ks * stride_hk, mask=t_mask, other=1e-30).to(tl.float32)
            q_k = tl.load(rows + ks * stride_hk + stride_hd, mask=t_mask, other=0.0).to(tl.float32)
            new_scale = tl.maximum(scale, s_k)
            r_old = scale / new_scale
            r_k = s_k / new_scale
            sumsq = sumsq * (r_old * r_old) + q_k * (r_k * r_k)
            scale = new_scale
        else:
            sumsq += tl.load(rows + ks * stride_hk, mask=t_mask, other=0.0).to(tl.float32)
    if SCALED_NORM:
        norm = scale * tl.sqrt(sumsq)
    else:
        norm = tl.sqrt(sumsq)
    return 1.0 / tl.maximum(norm, eps)


def _gate_values(raw, inv_norm, thr_ptr, temp_ptr, offs_n, n_mask, valid, stride_thr, stride_temp,
                 gate_eps, inv_one_minus_geps):
    """The dead-zone gates of a (tokens, edits) tile of raw scores; 0 outside the valid tile."""
    tau = tl.load(thr_ptr + offs_n * stride_thr, mask=n_mask, other=0.0).to(tl.float32)
    alpha = tl.load(temp_ptr + offs_n * stride_temp, mask=n_mask, other=0.0).to(tl.float32)
    # Clamped below so exp(-z) stays finite; sigmoid(-80) is far inside the dead zone anyway.
    z = tl.maximum(alpha[None, :] * (raw * inv_norm[:, None] - tau[None, :]), -80.0)
    g = tl.maximum(tl.sigmoid(z) - gate_eps, 0.0) * inv_one_minus_geps
    return tl.where(valid, g, 0.0)


def _gate_add_writes(
    g, w_ptr, out_ptr, offs_n64, offs_t64, t_mask, row_open, col_open, wrote, pid_s, d_out, o_per_split,
    stride_wn, stride_wo, stride_os, stride_ot, stride_oo,
    MODE: tl.constexpr, O_SLICED: tl.constexpr, CAST_WRITES: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_O: tl.constexpr,
):
    """Add ``g @ U_chunk[:, o_lo:o_hi]`` to the program's target (see the modes in the module docstring).

    With ``O_SLICED`` the slice ``[o_lo, o_hi)`` is program axis 2's; without it, all of d_out
    (a constexpr, so that the unsliced kernels compile as before: some large tiles sit at the
    register limit and spill with the slice bounds live).
    """
    if O_SLICED:
        o_lo = tl.program_id(2) * o_per_split
        o_hi = tl.minimum(o_lo + o_per_split, d_out)
    else:
        o_lo = 0
        o_hi = d_out
    for o0 in range(o_lo, o_hi, BLOCK_O):
        offs_o = o0 + tl.arange(0, BLOCK_O)
        o_mask = offs_o < o_hi
        # Only the write rows of edits open for some token of the tile are read.
        u = tl.load(w_ptr + offs_n64[:, None] * stride_wn + offs_o[None, :] * stride_wo,
                    mask=col_open[:, None] & o_mask[None, :], other=0.0)
        if CAST_WRITES:
            part = tl.dot(g, u.to(tl.float32), input_precision=DOT_PREC)
        else:
            part = tl.dot(g.to(u.dtype), u, input_precision=DOT_PREC)
        o_ptrs = (out_ptr + pid_s.to(tl.int64) * stride_os + offs_t64[:, None] * stride_ot
                  + offs_o[None, :] * stride_oo)
        if MODE == 1:  # ATOMIC: relaxed, the sum needs no ordering with other memory
            tl.atomic_add(o_ptrs, part, mask=row_open[:, None] & o_mask[None, :], sem="relaxed")
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
    T, n, d, d_out, edits_per_split, col_offset, norm_col, n_kslices, o_per_split,
    stride_hk, stride_ht, stride_hd, stride_an, stride_ad, stride_thr, stride_temp, stride_wn, stride_wo,
    stride_os, stride_ot, stride_oo, stride_fs,
    eps, gate_eps, inv_one_minus_geps, t_bucket, n_bucket,
    MODE: tl.constexpr, FROM_SCORES: tl.constexpr, SCALED_NORM: tl.constexpr, CAST_SCORES: tl.constexpr,
    CAST_WRITES: tl.constexpr, DOT_PREC: tl.constexpr, O_SLICED: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_s = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    h_rows = h_ptr + offs_t64[:, None] * stride_ht

    # This program's edit range, in BLOCK_N chunks. The first chunk's scores are computed
    # before the loop: from h, the same pipelined loop over d also yields the row norms
    # (no separate pass over h before the first address is read).
    e_lo = pid_s * edits_per_split
    e_hi = tl.minimum(e_lo + edits_per_split, n)
    offs_n = e_lo + tl.arange(0, BLOCK_N)
    n_mask = offs_n < e_hi
    raw, scale, sumsq = _chunk_scores(
        h_rows, a_ptr, offs_n.to(tl.int64), n_mask, t_mask, t_mask[:, None] & n_mask[None, :], 0, d, n_kslices,
        col_offset, stride_hk, stride_hd, stride_an, stride_ad,
        FROM_SCORES, True, CAST_SCORES, DOT_PREC, BLOCK_T, BLOCK_N, BLOCK_D)
    if FROM_SCORES:
        inv_norm = _buffer_inv_norms(h_ptr, offs_t64, t_mask, n_kslices, norm_col, stride_hk, stride_ht, stride_hd,
                                     eps, SCALED_NORM, BLOCK_T)
    else:
        inv_norm = 1.0 / tl.maximum(scale * tl.sqrt(sumsq), eps)
    any_open = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for n0 in range(e_lo, e_hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < e_hi
        offs_n64 = offs_n.to(tl.int64)
        valid = t_mask[:, None] & n_mask[None, :]
        g = _gate_values(raw, inv_norm, thr_ptr, temp_ptr, offs_n, n_mask, valid, stride_thr, stride_temp,
                         gate_eps, inv_one_minus_geps)
        row_open = tl.max(g, axis=1) > 0.0          # (BLOCK_T,)
        col_open = tl.max(g, axis=0) > 0.0          # (BLOCK_N,)
        tile_open = tl.max(row_open.to(tl.int32), axis=0)
        if tile_open > 0:
            # 1 for every row once any chunk of this program has stored the tile (vector: the
            # interpreter rejects a scalar folded into a block mask).
            wrote = tl.zeros((BLOCK_T,), dtype=tl.int32) + tl.max(any_open, axis=0)
            _gate_add_writes(g, w_ptr, out_ptr, offs_n64, offs_t64, t_mask, row_open, col_open, wrote, pid_s,
                             d_out, o_per_split, stride_wn, stride_wo, stride_os, stride_ot, stride_oo,
                             MODE, O_SLICED, CAST_WRITES, DOT_PREC, BLOCK_O)
            any_open = tl.maximum(any_open, row_open.to(tl.int32))
        # The next chunk's raw scores; after the last chunk the d range is empty (nothing is read).
        nx_mask = (offs_n + BLOCK_N) < e_hi
        k_hi = tl.where(n0 + BLOCK_N < e_hi, d, 0)
        raw, _, _ = _chunk_scores(
            h_rows, a_ptr, offs_n64 + BLOCK_N, nx_mask, t_mask, t_mask[:, None] & nx_mask[None, :], 0, k_hi,
            n_kslices, col_offset, stride_hk, stride_hd, stride_an, stride_ad,
            FROM_SCORES, False, CAST_SCORES, DOT_PREC, BLOCK_T, BLOCK_N, BLOCK_D)
    if MODE == 2:
        tl.store(flag_ptr + pid_s.to(tl.int64) * stride_fs + offs_t64, any_open, mask=t_mask)


def _reduce_kernel(
    ws_ptr, flag_ptr, y_ptr, T, d_out, n_split,
    stride_ws, stride_wt, stride_fs, stride_yt, stride_yo,
    BLOCK_S: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """y += sum over splits of the flagged partial rows, BLOCK_S splits per step.

    Each step is one masked (splits, tokens, d_out) tile load and a ``tl.sum``
    over the splits; steps run in split order and the in-step reduction tree
    is fixed by the compiled kernel, so the bits are identical run to run.
    """
    pid_t = tl.program_id(0)
    pid_o = tl.program_id(1)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = offs_o < d_out
    acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
    rows = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for s0 in range(0, n_split, BLOCK_S):
        offs_s64 = (s0 + tl.arange(0, BLOCK_S)).to(tl.int64)
        f = tl.load(flag_ptr + offs_s64[:, None] * stride_fs + offs_t64[None, :],
                    mask=(offs_s64[:, None] < n_split) & t_mask[None, :], other=0)  # (S, T)
        # Rows a split did not write are masked out of the load (no memory moved for them).
        m = (f[:, :, None] > 0) & o_mask[None, None, :]
        part = tl.load(ws_ptr + offs_s64[:, None, None] * stride_ws + offs_t64[None, :, None] * stride_wt
                       + offs_o[None, None, :], mask=m, other=0.0)
        acc += tl.sum(part, axis=0)
        rows = tl.maximum(rows, tl.max(f, axis=0))
    if tl.max(rows, axis=0) > 0:
        m = (rows[:, None] > 0) & o_mask[None, :]
        y_ptrs = y_ptr + offs_t64[:, None] * stride_yt + offs_o[None, :] * stride_yo
        prev = tl.load(y_ptrs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (prev + acc).to(y_ptr.dtype.element_ty), mask=m)


def _scores_kernel(
    h_ptr, a_ptr, out_ptr, T, n, d, d_per_split,
    stride_ht, stride_hd, stride_an, stride_ad, stride_ok, stride_ot, stride_on, t_bucket, n_bucket,
    SCALED_NORM: tl.constexpr, CAST_SCORES: tl.constexpr, DOT_PREC: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Phase A: raw scores and row norms of the d range ``[k*d_per_split, ...)`` of program axis 2.

    Output slice k (``out[k, t, :]``): columns [0, n) the raw partial scores,
    column n the partial sum of squares (plain) or, with SCALED_NORM, columns n
    and n+1 its scale and scaled sum (see :func:`_buffer_inv_norms`). Edit
    blocks are visited grid-stride over program axis 1, so every block is
    scored whatever the launch caps that axis to.
    """
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_t64 = offs_t.to(tl.int64)
    h_rows = h_ptr + offs_t64[:, None] * stride_ht
    k_lo = pid_k * d_per_split
    k_hi = tl.minimum(k_lo + d_per_split, d)
    o_rows = out_ptr + pid_k.to(tl.int64) * stride_ok + offs_t64 * stride_ot
    for nb in range(pid_n, (n + BLOCK_N - 1) // BLOCK_N, tl.num_programs(1)):  # not tl.cdiv: a jit function
        offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < n
        offs_n64 = offs_n.to(tl.int64)
        valid = t_mask[:, None] & n_mask[None, :]
        raw, scale, sumsq = _chunk_scores(
            h_rows, a_ptr, offs_n64, n_mask, t_mask, valid, k_lo, k_hi, 1, 0, 0, stride_hd, stride_an, stride_ad,
            False, True, CAST_SCORES, DOT_PREC, BLOCK_T, BLOCK_N, BLOCK_D)
        tl.store(o_rows[:, None] + offs_n64[None, :] * stride_on, raw, mask=valid)
        # The norm columns are written by the first edit block only (vector: the interpreter
        # rejects scalar masks).
        first = t_mask & ((tl.zeros((BLOCK_T,), dtype=tl.int32) + nb) == 0)
        if SCALED_NORM:
            tl.store(o_rows + n * stride_on, scale, mask=first)
            tl.store(o_rows + (n + 1) * stride_on, sumsq, mask=first)
        else:
            norm = scale * tl.sqrt(sumsq)
            tl.store(o_rows + n * stride_on, norm * norm, mask=first)


# --------------------------------------------------------------------------
# Lazy jit.
# --------------------------------------------------------------------------

_DEVICE_FUNCTIONS = (_chunk_scores, _buffer_inv_norms, _gate_values, _gate_add_writes)
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
    ``gate_tuned`` (restores y), ``gate_tuned_ws`` (partial mode) and
    ``scores_tuned``.
    """
    namespace = dict(globals())
    for fn in _DEVICE_FUNCTIONS:
        namespace[fn.__name__] = _jit_in(namespace, fn)
    out = {name: _jit_in(namespace, fn) for name, fn in _KERNELS.items()}
    if not interpret:
        # Keyed on buckets of T and n (not their exact values) so that a changed edit
        # count does not retune. Only y needs restoring between timed runs, and only
        # where the kernel adds into it (direct and atomic modes); the partial mode
        # rewrites its workspace, so its variant restores nothing.
        key = ["t_bucket", "n_bucket", "d", "d_out", "MODE", "FROM_SCORES", "SCALED_NORM", "O_SLICED"]
        prune = {"early_config_prune": prune_gate_configs}
        out["gate_tuned"] = triton.autotune(configs=gate_configs(), key=key, prune_configs_by=prune,
                                            restore_value=["out_ptr"])(out["gate"])
        out["gate_tuned_ws"] = triton.autotune(configs=gate_configs(), key=key, prune_configs_by=prune)(out["gate"])
        out["scores_tuned"] = triton.autotune(configs=scores_configs(), key=["t_bucket", "n_bucket", "d", "d_per_split"],
                                              prune_configs_by=prune)(out["scores"])
    return out
