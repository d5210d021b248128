"""Launcher of the streaming decode kernels (S + W of :mod:`aloe_kernels.ops.stream_kernels`).

``ALOE_DECODE_KERNEL`` chooses the decode path of the fused gate for calls of at most
:data:`STREAM_MAX_TOKENS` tokens: ``split`` (the default: the split-K kernels of
:mod:`aloe_kernels.ops.gate_kernels`) or ``stream`` (these). The split path stays the default
until a GPU run shows the streaming one faster on that card; the GPU suite times both.
Prefill (more tokens) always takes the split path.

Launch plan, from shapes and the SM count only (safe under CUDA graphs): one program per SM
(at most one per step), 16 or 32 token columns, 64-edit blocks of 128 columns a step, 4 warps
(one warpgroup: the 64 edit rows are the M side of the product). Workspaces are
``(programs + edit blocks)`` partial tiles and the gate tiles of the edit blocks, a few MB at
100,000 edits.
"""

from __future__ import annotations

import os

import torch
import triton

from ..int8_format import GROUP
from ..runtime import STREAM_MAX_TOKENS, triton_interpreting
from . import buffers
from .buffers import device_guard
from .launch_plan import sm_count
from .stream_kernels import jit_stream_kernels

__all__ = [
    "DECODE_KERNEL_ENV",
    "STREAM_MAX_TOKENS",
    "aloe_stream_screened_residual_",
    "decode_kernel",
    "run_stream_gate",
    "stream_blocks",
]

#: Environment variable choosing the decode kernel: ``split`` (default) or ``stream``.
DECODE_KERNEL_ENV = "ALOE_DECODE_KERNEL"
DECODE_KERNELS = ("split", "stream")
#: Open flags W reads at once before it looks at single edit blocks.
_FLAG_BLOCK = 32
# Fixed blocks on a GPU (BLOCK_N, BLOCK_D, BLOCK_O), warps and pipeline stages: 64 x 128 bf16
# address tiles are 16 KB a stage, 3 stages ahead 60 KB in flight per SM. fp32 inputs take
# 64-column steps and fp32 writes 32-column tiles: wider ones spill registers in the sm_90
# compile (benchmarks/results/gpu/aot_stream_sm90.md).
_GPU_BLOCKS = (64, 128, 64)
_GPU_FP32_BLOCK_D = 64
_GPU_FP32_BLOCK_O = 32
_GPU_WARPS = 4
_GPU_STAGES = 4
# The int8 screen's tiles are half as large: 6 stages keep 60 KB in flight per SM.
_GPU_SCREEN_STAGES = 6
# Under the interpreter: small tiles, so that tests see several blocks, steps and programs.
_INTERPRETER_BLOCKS = (16, 32, 16)


def decode_kernel() -> str:
    """The decode kernel ``ALOE_DECODE_KERNEL`` selects (``split`` when unset)."""
    choice = os.environ.get(DECODE_KERNEL_ENV, "split").strip().lower() or "split"
    if choice not in DECODE_KERNELS:
        raise ValueError(f"{DECODE_KERNEL_ENV}={choice!r}: expected one of {', '.join(DECODE_KERNELS)}")
    return choice


def stream_blocks(T: int, interpret: bool, block_t: int = 0, block_n: int = 0, block_d: int = 0, block_o: int = 0,
                  *, fp32_scores: bool = False, fp32_writes: bool = False) -> dict:
    """Block sizes of a streaming launch; any given one (> 0, a power of two, at least 16) wins.

    ``fp32_scores`` / ``fp32_writes``: h or the addresses / the writes are float32 (narrower GPU tiles).
    """
    bn, bd, bo = _INTERPRETER_BLOCKS if interpret else _GPU_BLOCKS
    if not interpret:
        bd = _GPU_FP32_BLOCK_D if fp32_scores else bd
        bo = _GPU_FP32_BLOCK_O if fp32_writes else bo
    out = {"block_t": 16 if T <= 16 else 32, "block_n": bn, "block_d": bd, "block_o": bo}
    for name, v in (("block_t", block_t), ("block_n", block_n), ("block_d", block_d), ("block_o", block_o)):
        if v > 0:
            if v & (v - 1) or v < 16:
                raise ValueError(f"{name} of the streaming kernel must be a power of two >= 16, got {v}")
            out[name] = int(v)
    if out["block_t"] < T:
        raise ValueError(f"block_t={out['block_t']} is below the {T} tokens of the call (one token tile)")
    return out


def run_stream_gate(y2: torch.Tensor, h2: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor,
                    temperatures: torch.Tensor, writes: torch.Tensor, eps: float, gate_eps: float, *,
                    programs: int = 0, blocks_given: tuple = (0, 0, 0, 0),
                    program_order: torch.Tensor | None = None, screen: tuple | None = None) -> None:
    """``y2 += U g(h2)`` with kernel S then kernel W (two launches); ``T <= STREAM_MAX_TOKENS``.

    ``programs``: number of persistent programs of S (0: one per SM). ``program_order``: a
    permutation of ``range(programs)`` mapping launch slots to programs (tests only: under the
    interpreter programs run in launch order, so this decides which arrives last).

    ``screen``: ``(values, scales, limits)`` of int8 addresses
    (:class:`aloe_kernels.int8_addresses.Int8Addresses` and its ``screen_limits``). Then a first S
    pass streams the int8 values and marks the edits some token may open; the second reads only
    those rows of ``addresses``, in the same steps and segments as a plain call, so every gate has
    the bits a plain call gives (three launches).
    """
    T, d_out = y2.shape
    n, d = addresses.shape
    if T == 0 or n == 0:
        return
    if T > STREAM_MAX_TOKENS:
        raise ValueError(f"the streaming kernel takes at most {STREAM_MAX_TOKENS} tokens, got {T}")
    interpret = triton_interpreting()
    f32 = torch.float32
    b = stream_blocks(T, interpret, *blocks_given, fp32_scores=f32 in (h2.dtype, addresses.dtype),
                      fp32_writes=writes.dtype == f32)
    bt, bn, bo = b["block_t"], b["block_n"], b["block_o"]
    dev = y2.device
    n_blocks = triton.cdiv(n, bn)
    gates = buffers.empty_workspace((n_blocks, bn, bt), dev, torch.float32)
    flags = buffers.empty_workspace((n_blocks,), dev, torch.int32)
    keep = buffers.empty_workspace((n,), dev, torch.int32) if screen is not None else flags
    kept_blocks = buffers.empty_workspace((n_blocks,), dev, torch.int32) if screen is not None else flags
    use_pdl = (not interpret) and torch.cuda.get_device_capability(dev)[0] >= 9
    k = jit_stream_kernels(interpret)
    extra = {} if interpret else {"num_warps": _GPU_WARPS, "num_stages": _GPU_STAGES}
    common = dict(h2=h2, thresholds=thresholds, temperatures=temperatures, gates=gates, flags=flags, keep=keep,
                  kept_blocks=kept_blocks, eps=eps, gate_eps=gate_eps, bt=bt, bn=bn, programs=programs,
                  use_pdl=use_pdl, extra=extra)
    with device_guard(y2):
        if screen is not None:
            values, scales, limits = screen
            _check_screen(values, scales, limits, n, d)
            if any(t.device != dev for t in screen):
                raise ValueError(f"the screen's tensors must be on {dev}, with the operator")
            _launch_scores(k, 1, values, GROUP, common, qs=scales, lim=limits)
        _launch_scores(k, 2 if screen is not None else 0, addresses, b["block_d"], common, order=program_order)
        k["write"][(triton.cdiv(d_out, bo),)](
            flags, gates, writes, y2, T, n_blocks, d_out,
            writes.stride(0), writes.stride(1), y2.stride(0), y2.stride(1),
            CAST_WRITES=interpret or writes.dtype == torch.float32, DOT_PREC="ieee", USE_PDL=use_pdl,
            BLOCK_T=bt, BLOCK_N=bn, BLOCK_O=bo, BLOCK_F=_FLAG_BLOCK,
            **extra, **({"launch_pdl": True} if use_pdl else {}),
        )


def _check_screen(values: torch.Tensor, scales: torch.Tensor, limits: torch.Tensor, n: int, d: int) -> None:
    if values.dtype != torch.int8 or tuple(values.shape) != (n, d) or values.stride(1) != 1:
        raise ValueError(f"screen values must be contiguous int8 ({n}, {d}), got {values.dtype} {tuple(values.shape)}")
    if scales.dtype != torch.float16 or tuple(scales.shape) != (n, triton.cdiv(d, GROUP)):
        raise ValueError(f"screen scales must be float16 ({n}, {triton.cdiv(d, GROUP)}), got {scales.dtype} "
                         f"{tuple(scales.shape)}")
    if limits.dtype != torch.float32 or tuple(limits.shape) != (n,):
        raise ValueError(f"screen limits must be float32 ({n},), got {limits.dtype} {tuple(limits.shape)}")


def _launch_scores(k: dict, mode: int, a: torch.Tensor, bd: int, c: dict, qs: torch.Tensor | None = None,
                   lim: torch.Tensor | None = None, order: torch.Tensor | None = None) -> None:
    """One pass of kernel S over ``a`` (addresses, or int8 values with ``mode`` 1) in steps of ``bd`` columns."""
    h2, bt, bn = c["h2"], c["bt"], c["bn"]
    T = h2.shape[0]
    n, d = a.shape
    dev = h2.device
    # int8 values are exact in the state's dtype; a float32 state, or the interpreter, takes fp32 tiles
    cast = triton_interpreting() or (h2.dtype == torch.float32 if mode == 1 else h2.dtype != a.dtype)
    n_blocks, k_steps = triton.cdiv(n, bn), triton.cdiv(d, bd)
    total = n_blocks * k_steps
    progs = max(1, min(c["programs"] if c["programs"] > 0 else sm_count(dev), total))
    if (total + 1) * progs >= 2**31:  # the kernel's step arithmetic is 32-bit
        raise ValueError(f"{n} edits x {d} columns is too many steps for the streaming kernel; use the split one")
    if order is not None and (order.numel() != progs or order.device != dev):
        raise ValueError(f"program_order must hold {progs} program ids on {dev}")
    part = buffers.empty_workspace((progs + n_blocks, bn, bt), dev, torch.float32)
    sq = buffers.empty_workspace((progs + n_blocks, bt), dev, torch.float64)
    tickets = buffers.ticket_counters(dev, n_blocks)
    flags = c["flags"]
    k["scores"][(progs,)](
        h2, a, c["thresholds"], c["temperatures"], part, sq, tickets, flags, c["gates"],
        order.to(torch.int32) if order is not None else flags,
        qs if qs is not None else flags, lim if lim is not None else flags, c["keep"], c["kept_blocks"],
        T, n, d, k_steps, total, progs,
        h2.stride(0), h2.stride(1), a.stride(0), a.stride(1),
        c["thresholds"].stride(0), c["temperatures"].stride(0), qs.stride(0) if qs is not None else 0,
        float(c["eps"]), float(c["gate_eps"]), 1.0 / (1.0 - float(c["gate_eps"])),
        MODE=mode, PERMUTED=order is not None, CAST=cast,
        DOT_PREC="ieee", USE_PDL=c["use_pdl"], BLOCK_T=bt, BLOCK_N=bn, BLOCK_D=bd,
        **({**c["extra"], "num_stages": _GPU_SCREEN_STAGES} if mode == 1 and c["extra"] else c["extra"]),
    )


# --------------------------------------------------------------------------
# torch custom op of the screened decode path (int8 addresses first).
# --------------------------------------------------------------------------


@torch.library.custom_op("aloe::stream_gate_screened_", mutates_args=("y",))
def _stream_screened_op(y: torch.Tensor, h: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor,
                        temperatures: torch.Tensor, writes: torch.Tensor, values: torch.Tensor, scales: torch.Tensor,
                        limits: torch.Tensor, eps: float, gate_eps: float) -> None:
    d, d_out = addresses.shape[1], writes.shape[1]
    run_stream_gate(y.view(-1, d_out), h.reshape(-1, d), addresses, thresholds, temperatures, writes, eps, gate_eps,
                    screen=(values, scales, limits))


@_stream_screened_op.register_fake
def _stream_screened_fake(y, h, addresses, thresholds, temperatures, writes, values, scales, limits, eps, gate_eps) -> None:
    return None


def aloe_stream_screened_residual_(y: torch.Tensor, h: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor,
                                   temperatures: torch.Tensor, writes: torch.Tensor, eps: float, gate_eps: float,
                                   screen: tuple) -> torch.Tensor:
    """``y += U g(h)`` in place for at most :data:`STREAM_MAX_TOKENS` tokens, through the int8 screen
    ``screen = (values, scales, limits)`` then the full-precision rows it keeps (the bits of a plain
    streaming call); ``torch.ops.aloe.stream_gate_screened_``. ``y`` must be viewable as (T, d_out)."""
    d = addresses.shape[1]
    T = h.numel() // d
    if T > STREAM_MAX_TOKENS:
        raise ValueError(f"the screened decode path takes at most {STREAM_MAX_TOKENS} tokens, got {T}")
    torch.ops.aloe.stream_gate_screened_(y, h, addresses, thresholds, temperatures, writes, *screen, float(eps),
                                         float(gate_eps))
    return y
