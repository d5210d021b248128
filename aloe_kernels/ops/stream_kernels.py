"""The decode kernels of the ALOE gate (T <= 32): one persistent streaming pass over the addresses (S),
then a sparse write (W). Selected with ``ALOE_DECODE_KERNEL=stream`` (:mod:`aloe_kernels.ops.stream_gate`).

Why a second decode path
------------------------
At decode, the cost floor is reading the addresses once (n x d values). The
split path of :mod:`aloe_kernels.ops.gate_kernels` needs three launches at
decode (scores, gate, reduce), leaves SMs idle when its edit ranges do not
divide evenly, and carries an overflow-safe running norm (a division per
step). These two kernels are built for that floor:

Kernel S (``_stream_scores_kernel``), one program per SM
--------------------------------------------------------
- **Work.** The address matrix is cut into *steps*: (edit block of
  ``BLOCK_N`` rows) x (``BLOCK_D`` columns), edit-block major. There are
  ``n_blocks * k_steps`` of them and program p takes the contiguous range
  ``[p * steps // P, (p + 1) * steps // P)``, so every address is read
  exactly once and the programs' shares differ by at most one step. The
  loop over a program's steps is one flat loop (no nested loop to drain the
  software pipeline at an edit-block boundary).
- **Product.** Each step computes ``V_tile @ h_tile^T``, a (BLOCK_N, BLOCK_T)
  tile: the edits are the M side of the product and the padded tokens the
  N side ("swap-AB"), so that 64 or 128 edit rows fill the tensor-core
  instruction and one to 32 tokens are its narrow side.
- **Norm.** The squared row norms are a plain column sum of ``h^2``, in
  float64 (rows of 1e30 square to 1e60, which float32 cannot hold): no
  running scale and no division inside the loop.
- **Cross-program sum, deterministic.** Where a program's range leaves an
  edit block (or ends), it stores its partial scores and partial squared
  norms into *segment* ``p + b``: the segments, numbered in step order,
  are exactly ``owner(step) + block(step)``, so the segments of block b are
  a contiguous range known to every program. It then takes a ticket from
  block b's counter (an atomic add, acquire-release, after a barrier so
  that all of its warps' stores come first). The program that takes the
  last ticket sums the block's segments **in segment order** (so the bits
  do not depend on which program arrives last), normalises, computes the
  gates, writes the block's open flag (always) and its gate tile (only when
  some gate opened), and resets the counter to 0 for the next launch: no
  memset launch. The counters live in a zeroed buffer kept per device.

Kernel W (``_stream_write_kernel``), one program per ``BLOCK_O`` columns of y
-----------------------------------------------------------------------------
Reads the open flags ``BLOCK_F`` at a time; for each open block it reads the
gate tile and only the write rows of edits that opened (a predicated load
moves no memory), accumulates ``g @ U`` in fp32 in block order, and adds the
sum into y with one rounding, on the token rows that some gate opened (the
others keep their exact bits). It can be launched as a programmatic
dependent launch (``USE_PDL``): it then waits on S's completion in-kernel
(``gdc_wait``) instead of at the launch boundary.

int8 addresses (``MODE``)
------------------------
With a screen (:mod:`aloe_kernels.int8_addresses`), S runs twice. Mode 1 streams the int8 values
(one float16 scale per step of 128 columns) and its finishing program writes, per edit, whether some
token's screen score reaches the edit's limit, per block whether it holds such an edit, and the open
flag 0 of blocks that do not. Mode 2 visits only the blocks that do, each program over its own steps
of them (the plain call's segments: same tiles, same order), reading only the kept rows, so every row's
sum has the bits of a plain call (mode 0); rows the screen dropped get gate 0. Then W, as ever.

Two launches per call (three with a screen), no atomics on floating-point data, no host
synchronisation, identical bits whatever order the programs run in (for a
given program count). ``PERMUTED`` maps program ids through a table so
that tests under the interpreter (where programs run in order) can make any
program the last to arrive.
"""

from __future__ import annotations

import functools

import triton.language as tl

from .gate_kernels import _jit_in

__all__ = ["jit_stream_kernels"]


def _owner(step, total_steps, n_progs):
    """The program whose step range holds ``step`` (ranges ``[p * total // P, (p + 1) * total // P)``)."""
    return ((step + 1) * n_progs - 1) // total_steps


def _stream_scores_kernel(
    h_ptr, a_ptr, thr_ptr, temp_ptr, part_ptr, sq_ptr, ticket_ptr, flag_ptr, gate_ptr, perm_ptr,
    qs_ptr, lim_ptr, keep_ptr, kblk_ptr,
    T, n, d, k_steps, total_steps, n_progs,
    stride_ht, stride_hd, stride_an, stride_ad, stride_thr, stride_temp, stride_qs,
    eps, gate_eps, inv_one_minus_geps,
    MODE: tl.constexpr, PERMUTED: tl.constexpr, CAST: tl.constexpr, DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    if PERMUTED:
        pid = tl.load(perm_ptr + pid)
    s_lo = (pid * total_steps) // n_progs
    s_hi = ((pid + 1) * total_steps) // n_progs
    offs_t = tl.arange(0, BLOCK_T)
    t_mask = offs_t < T
    offs_bn = tl.arange(0, BLOCK_N)
    offs_bd = tl.arange(0, BLOCK_D)
    tile = offs_bn[:, None] * BLOCK_T + offs_t[None, :]  # (BLOCK_N, BLOCK_T) offsets in a segment
    b_first = s_lo // k_steps
    b_last = (s_hi - 1) // k_steps
    if MODE == 2:
        # Rescoring: only edit blocks holding a kept edit, each program over its own steps of them (the
        # plain call's segments), reading only the kept rows.
        for blk in range(b_first, b_last + 1):
            if tl.load(kblk_ptr + blk) > 0:
                _rescore_segment(h_ptr, a_ptr, keep_ptr, part_ptr, sq_ptr, pid, blk, tl.maximum(s_lo, blk * k_steps),
                                 tl.minimum(s_hi, (blk + 1) * k_steps), k_steps, n, d, tile, offs_t, t_mask, offs_bn,
                                 offs_bd, stride_ht, stride_hd, stride_an, stride_ad, CAST, DOT_PREC,
                                 BLOCK_T, BLOCK_N, BLOCK_D)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        sq = tl.zeros((BLOCK_D, BLOCK_T), dtype=tl.float64)  # reduced over d only when a segment ends
        b = b_first  # edit block and d step of s, carried (no division in the loop)
        kk = s_lo - b * k_steps
        for s in range(s_lo, s_hi):
            offs_n = b * BLOCK_N + offs_bn
            n_mask = offs_n < n
            offs_d = kk * BLOCK_D + offs_bd
            d_mask = offs_d < d
            x_t = tl.load(h_ptr + offs_t[None, :] * stride_ht + offs_d[:, None] * stride_hd,
                          mask=d_mask[:, None] & t_mask[None, :], other=0.0)          # (BLOCK_D, BLOCK_T)
            v = tl.load(a_ptr + offs_n.to(tl.int64)[:, None] * stride_an + offs_d[None, :] * stride_ad,
                        mask=n_mask[:, None] & d_mask[None, :], other=0)              # (BLOCK_N, BLOCK_D)
            x64 = x_t.to(tl.float64)
            sq += x64 * x64
            if MODE == 1:  # screen: int8 values (exact in the state's dtype), one scale per step (BLOCK_D = group)
                sc = tl.load(qs_ptr + offs_n * stride_qs + kk, mask=n_mask, other=0.0).to(tl.float32)
                if CAST:
                    part = tl.dot(v.to(tl.float32), x_t.to(tl.float32), input_precision=DOT_PREC)
                else:
                    part = tl.dot(v.to(x_t.dtype), x_t)
                acc += sc[:, None] * part
            else:
                if CAST:
                    x_t = x_t.to(tl.float32)
                    v = v.to(tl.float32)
                acc = tl.dot(v, x_t, acc, input_precision=DOT_PREC)
            if (kk == k_steps - 1) | (s == s_hi - 1):  # the segment ends: store its partials
                tl.store(part_ptr + (pid + b) * (BLOCK_N * BLOCK_T) + tile, acc)
                tl.store(sq_ptr + (pid + b) * BLOCK_T + offs_t, tl.sum(sq, axis=0))
                acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
                sq = tl.zeros((BLOCK_D, BLOCK_T), dtype=tl.float64)
            kk += 1
            wrap = kk == k_steps
            b = tl.where(wrap, b + 1, b)
            kk = tl.where(wrap, 0, kk)
    # Tickets are taken after the streaming loop, so that it stays an innermost loop (software
    # pipelined); a barrier first, so that every warp's partial stores precede them.
    tl.debug_barrier()
    for blk in range(b_first, b_last + 1):
        if (MODE != 2) or (tl.load(kblk_ptr + blk) > 0):
            _finish_block_if_last(blk, k_steps, total_steps, n_progs, tile, offs_bn, t_mask, part_ptr, sq_ptr,
                                  ticket_ptr, flag_ptr, gate_ptr, thr_ptr, temp_ptr, lim_ptr, keep_ptr, kblk_ptr, n,
                                  stride_thr, stride_temp, eps, gate_eps, inv_one_minus_geps, MODE, BLOCK_T, BLOCK_N)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


def _rescore_segment(h_ptr, a_ptr, keep_ptr, part_ptr, sq_ptr, pid, blk, lo, hi, k_steps, n, d, tile, offs_t, t_mask,
                     offs_bn, offs_bd, stride_ht, stride_hd, stride_an, stride_ad, CAST: tl.constexpr,
                     DOT_PREC: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """Steps ``[lo, hi)`` of edit block ``blk`` as the plain pass runs them (same tiles, same order, so
    the same bits per row), reading only the rows the screen kept; stores segment ``pid + blk``."""
    offs_n = blk * BLOCK_N + offs_bn
    n_mask = offs_n < n
    row_mask = n_mask & (tl.load(keep_ptr + offs_n, mask=n_mask, other=0) > 0)
    acc = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
    sq = tl.zeros((BLOCK_D, BLOCK_T), dtype=tl.float64)
    for s in range(lo, hi):
        offs_d = (s - blk * k_steps) * BLOCK_D + offs_bd
        d_mask = offs_d < d
        x_t = tl.load(h_ptr + offs_t[None, :] * stride_ht + offs_d[:, None] * stride_hd,
                      mask=d_mask[:, None] & t_mask[None, :], other=0.0)
        v = tl.load(a_ptr + offs_n.to(tl.int64)[:, None] * stride_an + offs_d[None, :] * stride_ad,
                    mask=row_mask[:, None] & d_mask[None, :], other=0)
        x64 = x_t.to(tl.float64)
        sq += x64 * x64
        if CAST:
            x_t = x_t.to(tl.float32)
            v = v.to(tl.float32)
        acc = tl.dot(v, x_t, acc, input_precision=DOT_PREC)
    tl.store(part_ptr + (pid + blk) * (BLOCK_N * BLOCK_T) + tile, acc)
    tl.store(sq_ptr + (pid + blk) * BLOCK_T + offs_t, tl.sum(sq, axis=0))


def _finish_block_if_last(b, k_steps, total_steps, n_progs, tile, offs_bn, t_mask, part_ptr, sq_ptr, ticket_ptr,
                          flag_ptr, gate_ptr, thr_ptr, temp_ptr, lim_ptr, keep_ptr, kblk_ptr, n, stride_thr, stride_temp,
                          eps, gate_eps, inv_one_minus_geps, MODE: tl.constexpr, BLOCK_T: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    """Take a ticket of edit block ``b``; the program that takes the last one finishes the block:
    its gates and open flag (MODE 0 and 2) or, for the screen (MODE 1), its rows' keep flags, whether
    it holds a kept edit, and (when it does not) its open flag, 0."""
    first = _owner(b * k_steps, total_steps, n_progs) + b
    last = _owner(b * k_steps + k_steps - 1, total_steps, n_progs) + b
    ticket = tl.atomic_add(ticket_ptr + b, 1, sem="acq_rel", scope="gpu")
    if ticket == last - first:
        raw = tl.zeros((BLOCK_N, BLOCK_T), dtype=tl.float32)
        tot = tl.zeros((BLOCK_T,), dtype=tl.float64)
        for sg in range(first, last + 1):  # segment order: the same bits whoever arrives last
            raw += tl.load(part_ptr + sg * (BLOCK_N * BLOCK_T) + tile, cache_modifier=".cg")
            tot += tl.load(sq_ptr + sg * BLOCK_T + tl.arange(0, BLOCK_T), cache_modifier=".cg")
        offs_n = b * BLOCK_N + offs_bn
        n_mask = offs_n < n
        valid = n_mask[:, None] & t_mask[None, :]
        inv_norm = 1.0 / tl.maximum(tl.sqrt(tot).to(tl.float32), eps)
        if MODE == 1:
            limit = tl.load(lim_ptr + offs_n, mask=n_mask, other=float("inf"))
            may = (raw * inv_norm[None, :] >= limit[:, None]) & valid
            kept = tl.max(may.to(tl.int32), axis=1)
            tl.store(keep_ptr + offs_n, kept, mask=n_mask)
            any_kept = tl.max(kept, axis=0)
            tl.store(kblk_ptr + b, any_kept)
            if any_kept == 0:  # closed for every token; a block with a kept edit gets its flag when rescored
                tl.store(flag_ptr + b, any_kept)
        else:
            tau = tl.load(thr_ptr + offs_n * stride_thr, mask=n_mask, other=0.0).to(tl.float32)
            alpha = tl.load(temp_ptr + offs_n * stride_temp, mask=n_mask, other=0.0).to(tl.float32)
            # Clamped below so exp(-z) stays finite; sigmoid(-80) is far inside the dead zone anyway.
            z = tl.maximum(alpha[:, None] * (raw * inv_norm[None, :] - tau[:, None]), -80.0)
            g = tl.maximum(tl.sigmoid(z) - gate_eps, 0.0) * inv_one_minus_geps
            if MODE == 2:  # rows the screen dropped are provably closed
                valid = valid & (tl.load(keep_ptr + offs_n, mask=n_mask, other=0) > 0)[:, None]
            g = tl.where(valid, g, 0.0)
            is_open = (tl.max(tl.max(g, axis=1), axis=0) > 0.0).to(tl.int32)
            tl.store(flag_ptr + b, is_open)
            if is_open > 0:
                tl.store(gate_ptr + b * (BLOCK_N * BLOCK_T) + tile, g)
        tl.atomic_xchg(ticket_ptr + b, 0, sem="relaxed", scope="gpu")  # ready for the next launch


def _stream_write_kernel(
    flag_ptr, gate_ptr, w_ptr, y_ptr, T, n_blocks, d_out,
    stride_wn, stride_wo, stride_yt, stride_yo,
    CAST_WRITES: tl.constexpr, DOT_PREC: tl.constexpr, USE_PDL: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_F: tl.constexpr,
):
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
    offs_o = tl.program_id(0) * BLOCK_O + tl.arange(0, BLOCK_O)
    o_mask = offs_o < d_out
    offs_t = tl.arange(0, BLOCK_T)
    offs_bn = tl.arange(0, BLOCK_N)
    tile = offs_bn[:, None] * BLOCK_T + offs_t[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_O), dtype=tl.float32)
    rows = tl.zeros((BLOCK_T,), dtype=tl.int32)
    for f0 in range(0, n_blocks, BLOCK_F):
        offs_f = f0 + tl.arange(0, BLOCK_F)
        flags = tl.load(flag_ptr + offs_f, mask=offs_f < n_blocks, other=0)
        if tl.max(flags, axis=0) > 0:
            for b in range(f0, tl.minimum(f0 + BLOCK_F, n_blocks)):  # block order: fixed sum order
                if tl.load(flag_ptr + b) > 0:
                    g = tl.load(gate_ptr + b * (BLOCK_N * BLOCK_T) + tile)   # (BLOCK_N, BLOCK_T)
                    col_open = tl.max(g, axis=1) > 0.0
                    offs_n = b * BLOCK_N + offs_bn
                    # Only the write rows of edits that opened are read.
                    u = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_o[None, :] * stride_wo,
                                mask=col_open[:, None] & o_mask[None, :], other=0.0)
                    g_t = tl.trans(g)
                    if CAST_WRITES:
                        acc = tl.dot(g_t, u.to(tl.float32), acc, input_precision=DOT_PREC)
                    else:
                        acc = tl.dot(g_t.to(u.dtype), u, acc, input_precision=DOT_PREC)
                    rows = tl.maximum(rows, (tl.max(g, axis=0) > 0.0).to(tl.int32))
    if tl.max(rows, axis=0) > 0:
        m = (rows[:, None] > 0) & o_mask[None, :]
        y_ptrs = y_ptr + offs_t.to(tl.int64)[:, None] * stride_yt + offs_o[None, :] * stride_yo
        prev = tl.load(y_ptrs, mask=m, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (prev + acc).to(y_ptr.dtype.element_ty), mask=m)


_DEVICE_FUNCTIONS = (_owner, _rescore_segment, _finish_block_if_last)
_KERNELS = {"scores": _stream_scores_kernel, "write": _stream_write_kernel}


@functools.lru_cache(maxsize=None)
def jit_stream_kernels(interpret: bool) -> dict:
    """jit S (``scores``) and W (``write``) for the current mode, as :func:`gate_kernels.jit_kernels` does."""
    namespace = dict(globals())
    for fn in _DEVICE_FUNCTIONS:
        namespace[fn.__name__] = _jit_in(namespace, fn)
    return {name: _jit_in(namespace, fn) for name, fn in _KERNELS.items()}
