"""Host-side launch planning of the fused gate kernels: mode, edit split, blocks, autotuning.

Everything here is decided from shapes, dtypes and the SM count only (no
``.item()``, no host synchronisation), so a launch is safe under CUDA graphs.

Split-K
-------
When the narrowest phase-A grid (16-edit blocks x token tiles of 64) has
fewer than twice as many programs as SMs (decode with up to ~4,000 edits,
batch 1 to 64: 82 blocks at 1,301 edits for 132 SMs), d is split into 4 to 8
slices of multiples of 256 columns, for at least ``2 * n_sms`` programs
streaming addresses; the gate then reads the summed slice scores (see
:mod:`aloe_kernels.ops.gate_kernels`). ``k_split`` overrides it. A gate
reading scores also splits d_out into slices of multiples of 256 columns,
for about ``4 * n_sms`` programs writing (``o_split``).

Autotuning
----------
On CUDA, non-deterministic calls use ``triton.autotune`` over Hopper-oriented
configurations keyed on (T bucket, n bucket, d, d_out, mode): powers of two,
so a changed edit count retunes only when it crosses one. Configurations much
taller than the token count are pruned, and so are the tiles that spill when
the gate reads a scores buffer. Tuning runs once per key, restoring
``y`` where the kernel adds into it (direct and atomic modes; the partial
mode's workspace is rewritten and is not restored), so warm up before
CUDA-graph capture. A key first met during capture (where benchmarking would
fail) runs with the fixed blocks instead, with a warning (:func:`may_autotune`);
``ALOE_KERNEL_AUTOTUNE=0`` makes every launch take them (no benchmarking at startup).
Deterministic mode uses a fixed configuration chosen from
the shapes, so its bits do not depend on timing noise across processes; so do
explicit block sizes and fp32 input tiles (the autotuning space is sized for
16-bit tiles; fp32 ones take narrower fixed blocks). Every configuration of
the autotuning spaces and every fixed one compiles for sm_90 without register
spills (``benchmarks/aot/aot_sm90.py``, table in
``benchmarks/results/gpu/aot_sm90.md``). Under
the interpreter there is one configuration (``INTERPRETER_BLOCKS``) and block
sizes can be passed explicitly (``block_t``, ``block_n``, ``block_d``,
``block_o``) so tests can use small shapes with ragged tiles.
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import torch
import triton

__all__ = [
    "GatePlan",
    "INTERPRETER_BLOCKS",
    "INTERPRETER_SMS",
    "MAX_GRID_Y",
    "MODE_ATOMIC",
    "MODE_DIRECT",
    "MODE_PARTIAL",
    "PARTIAL_WS_BUDGET",
    "block_meta",
    "gate_configs",
    "launch_params",
    "may_autotune",
    "n_bucket",
    "plan_launch",
    "prune_gate_configs",
    "reduce_blocks",
    "resolve_blocks",
    "scores_configs",
    "scores_grid",
    "sm_count",
    "t_bucket",
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
#: Largest second grid dimension CUDA accepts.
MAX_GRID_Y = 65535
_EDIT_GRAIN = 16  # edit ranges per split are multiples of this
_D_GRAIN = 256  # d slices of the split-K path are multiples of this (the widest BLOCK_D)
_MAX_K_SPLIT = 8  # more d slices only add scores traffic and phase-B work
_MIN_K_SPLIT = 4  # fewer did not pay on an H100 (the split-K docstring of _plan_k_split)
_O_GRAIN = 256  # d_out slices of a gate reading scores are multiples of this (a whole number of BLOCK_O)
_WRITE_PROGRAMS_PER_SM = 4  # programs a gate reading scores aims for, per SM
_O_SLICED_MAX_T = 32  # most tokens for which d_out is sliced automatically (decode batches)
_SCORES_TILE_MAX = 64 * 64  # largest (BLOCK_T x BLOCK_N) gate tile reading a scores buffer


@dataclass(frozen=True)
class GatePlan:
    """How a call is launched: mode, edit split, d split (split-K) and number of launches."""

    mode: int
    split: int
    edits_per_split: int
    launches: int
    k_split: int = 1
    d_per_split: int = 0
    o_split: int = 1
    o_per_split: int = 0

    @property
    def mode_name(self) -> str:
        return _MODE_NAMES[self.mode]


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (cached); :data:`INTERPRETER_SMS` elsewhere."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_SMS


def t_bucket(T: int) -> int:
    """Token count rounded up to a power of two (at most 8192): the autotuning key, not T itself."""
    return min(1 << max(0, (T - 1).bit_length()), 8192)


def n_bucket(n: int) -> int:
    """Edit count rounded up to a power of two (at least 16): the autotuning key, not n itself."""
    return max(16, 1 << max(0, (n - 1).bit_length()))


def scores_grid(T: int, n: int, k_split: int, block_t: int, block_n: int) -> tuple:
    """Grid of the phase-A scores kernel: (token tiles, edit blocks capped at :data:`MAX_GRID_Y`, d slices).

    The kernel visits edit blocks grid-stride over axis 1, so the cap drops none.
    """
    return (triton.cdiv(T, block_t), max(1, min(triton.cdiv(n, block_n), MAX_GRID_Y)), k_split)


def reduce_blocks(T: int, n_split: int, d_out: int, block_o: int = 0) -> dict:
    """Tiles of the partial-sum reduction: up to 32 splits per step, tiles of at most 4,096 values.

    Few tokens (decode) get narrow d_out tiles so that more programs share the
    work; the token tile fills what the split and d_out tiles leave.
    """
    bs = min(32, 1 << max(0, (n_split - 1).bit_length()))
    bo = block_o if block_o > 0 else (64 if T < 16 else 128)
    bt = max(1, min(32, 1 << max(0, (T - 1).bit_length()), 4096 // (bs * bo)))
    return {"BLOCK_S": bs, "BLOCK_T": bt, "BLOCK_O": bo}


#: ``ALOE_KERNEL_AUTOTUNE=0``: every launch takes the fixed blocks (no benchmarking at startup).
AUTOTUNE_ENV = "ALOE_KERNEL_AUTOTUNE"
#: Launch keys already run through the autotuned kernels (each benchmarked its configurations then).
_AUTOTUNED: set[tuple] = set()


def may_autotune(key: tuple, device: torch.device) -> bool:
    """Whether a launch with ``key`` may take the autotuned kernels.

    The first tuned launch of a key benchmarks every configuration and synchronises the host,
    which CUDA-graph capture forbids. Outside capture: yes, and the key is remembered. During
    capture: only for a key already tuned; a new one runs with the fixed blocks (a warning says
    so, since the captured graph then keeps them). Never with ``ALOE_KERNEL_AUTOTUNE=0``.
    """
    if os.environ.get(AUTOTUNE_ENV, "1") == "0":
        return False
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        if key in _AUTOTUNED:
            return True
        warnings.warn(
            f"ALOE kernel: launch key {key} first met during CUDA-graph capture; it runs with fixed blocks "
            "(warm up with this batch size before capture to autotune it)",
            RuntimeWarning,
            stacklevel=3,
        )
        return False
    _AUTOTUNED.add(key)
    return True


def plan_launch(
    T: int,
    n: int,
    d_out: int,
    y_dtype: torch.dtype,
    deterministic: bool,
    n_sms: int,
    split: int = 0,
    d: int = 0,
    k_split: int = 0,
    o_split: int = 0,
) -> GatePlan:
    """Pick mode, edit split, d split and d_out slices from shapes, dtypes and the SM count only (graph safe).

    ``d`` is the address width (0: the gate reads scores, as phase B of the
    tensor-parallel split does). ``split`` / ``k_split`` / ``o_split`` > 0
    override the choices; d_out slices are only taken by a gate reading scores.
    """
    if split <= 0:
        token_tiles = -(-T // 64)
        # Decode (one token tile): one edit range per SM. On an H100 at T = 1, n = 10,000, 132 ranges
        # took 183 us and 528 (4 per SM) 301 us, same tiles (benchmarks/results/gpu/nvidia-h100-80gb-hbm3).
        ranges = n_sms if token_tiles == 1 else -(-4 * n_sms // token_tiles)
        split = max(1, min(-(-n // _EDIT_GRAIN), ranges))
    split = max(1, min(split, n, MAX_GRID_Y))
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
    k_split, d_per = _plan_k_split(T, n, d, n_sms, k_split)
    from_scores = d <= 0 or k_split > 1
    o_split, o_per = _plan_o_split(T, split, d_out, n_sms, o_split if from_scores else 1)
    launches = (2 if mode == MODE_PARTIAL else 1) + (1 if k_split > 1 else 0)
    return GatePlan(
        mode=mode,
        split=split,
        edits_per_split=per,
        launches=launches,
        k_split=k_split,
        d_per_split=d_per,
        o_split=o_split,
        o_per_split=o_per,
    )


def _even_slices(width: int, parts: int, grain: int) -> tuple:
    """(count, width) of at most ``parts`` slices of ``width`` columns, multiples of ``grain`` where they
    fit; one slice is the whole width."""
    parts = max(1, min(parts, width))
    if parts == 1:
        return 1, width
    grain = grain if width >= grain * parts else 1
    per = -(-width // parts)
    per = -(-per // grain) * grain
    return -(-width // per), per


def _plan_o_split(T: int, split: int, d_out: int, n_sms: int, o_split: int) -> tuple:
    """(number of d_out slices, width of each) written by separate programs of a gate reading scores.

    Enough slices for about ``_WRITE_PROGRAMS_PER_SM * n_sms`` programs (token
    tiles of 16 x edit ranges x slices), never below ``_O_GRAIN`` columns, and
    only for decode (at most ``_O_SLICED_MAX_T`` tokens): a prefill grid is
    large already, and its tall tiles spill registers with the slice bounds
    live (``benchmarks/results/gpu/aot_sm90.md``).
    """
    if o_split <= 0:
        programs = split * -(-T // 16)
        o_split = 1 if T > _O_SLICED_MAX_T else max(1, min(-(-_WRITE_PROGRAMS_PER_SM * n_sms // programs), d_out // _O_GRAIN))
    return _even_slices(d_out, o_split, _O_GRAIN)


def _plan_k_split(T: int, n: int, d: int, n_sms: int, k_split: int) -> tuple:
    """(number of d slices, width of each) of the split-K path.

    Chosen when the narrowest phase-A grid (``_EDIT_GRAIN``-edit blocks times
    token tiles of 64) has fewer than ``2 * n_sms`` programs: few tokens and
    up to ~4,000 edits. Without it each program streams its few edits over
    the whole of d (H100, T = 1: 113 us at 1,301 edits and 121 us at 2,600,
    against 49 and 69 us with 4 slices; at 10,000 edits 4 slices lose 2%;
    ``benchmarks/results/gpu/nvidia-h100-80gb-hbm3``). The d split then
    multiplies the programs streaming addresses to about ``2 * n_sms``, and
    at least ``_MIN_K_SPLIT``, never below ``_D_GRAIN`` columns a slice.
    Slices are multiples of ``_D_GRAIN`` so their tiles stay aligned.
    """
    if d <= 0:
        return 1, 0
    if k_split <= 0:
        # Token tiles of 64: one decode tile may cover a whole batch of 32, so counting tiles
        # of 16 there would skip the split that a batch of 1 gets.
        programs = -(-n // _EDIT_GRAIN) * -(-T // 64)
        k_split = 1
        if programs < 2 * n_sms:
            k_split = min(_MAX_K_SPLIT, max(_MIN_K_SPLIT, -(-2 * n_sms // programs)), d // _D_GRAIN)
    return _even_slices(d, k_split, _D_GRAIN)


# Fixed (untuned) tiles per token tile height: (BLOCK_T, BLOCK_N, BLOCK_D, BLOCK_O). Chosen so that
# no gate / scores variant spills registers in the sm_90 compile (benchmarks/results/gpu/aot_sm90.md):
# BLOCK_T 64 and 128 take 8 warps (``launch_params``), the 128-token tile takes 32 edits a chunk
# (64 spill in the split-K gate), and fp32 tiles (twice the registers of bf16 ones) are narrower and
# take 16-token tiles up to T = 1024 (32 x 32 spills in the atomic mode) and 16 edits a chunk above.
_FIXED_16BIT = {16: (16, 64, 128, 128), 32: (32, 32, 128, 128), 64: (64, 64, 128, 64), 128: (128, 32, 64, 64)}
_FIXED_FP32 = {16: (16, 32, 64, 64), 32: (16, 32, 64, 64), 64: (16, 32, 64, 64), 128: (128, 16, 32, 32)}


def _fixed_blocks(T: int, interpret: bool, wide: bool = False) -> dict:
    """Fixed block sizes for T tokens; ``wide``: some input tile is fp32 (see ``_FIXED_FP32``)."""
    if interpret:
        return dict(INTERPRETER_BLOCKS)
    bt = 16 if T <= 16 else 32 if T <= 32 else 64 if T <= 1024 else 128
    sizes = (_FIXED_FP32 if wide else _FIXED_16BIT)[bt]
    return dict(zip(("block_t", "block_n", "block_d", "block_o"), sizes))


def resolve_blocks(T: int, interpret: bool, block_t: int, block_n: int, block_d: int, block_o: int, wide: bool = False) -> dict:
    """Block sizes of an untuned launch: the fixed ones for T, overridden by any given (> 0, powers of two)."""
    base = _fixed_blocks(T, interpret, wide)
    given = {"block_t": block_t, "block_n": block_n, "block_d": block_d, "block_o": block_o}
    for k, v in given.items():
        if v and v > 0:
            if v & (v - 1):
                raise ValueError(f"{k} must be a power of two, got {v}")
            base[k] = int(v)
    return base


def block_meta(blocks: dict) -> dict:
    """The kernel's BLOCK_* constexprs for resolved ``blocks``."""
    return {
        "BLOCK_T": blocks["block_t"],
        "BLOCK_N": blocks["block_n"],
        "BLOCK_D": blocks["block_d"],
        "BLOCK_O": blocks["block_o"],
    }


def launch_params(blocks: dict, T: int, interpret: bool) -> dict:
    """num_warps / num_stages of an untuned launch (the interpreter takes none)."""
    if interpret:
        return {}
    # 64-token tiles spill with 4 warps (255 registers a thread) in the sm_90 compile.
    return {"num_warps": 8 if blocks["block_t"] >= 64 else 4, "num_stages": 3}


# --------------------------------------------------------------------------
# Autotuning configurations (CUDA only).
# --------------------------------------------------------------------------


def gate_configs() -> list:
    """Autotuning space of the gate kernel: decode-like and prefill-like tiles.

    Every configuration compiles for sm_90 without register spills in each
    mode (benchmarks/results/gpu/aot_sm90.md): write tiles are 64 wide
    (``BLOCK_O``; 32 for 128 x 128 tiles, 128 only for 32 x 32), 64 x 64
    tiles with BLOCK_D 128 take 8 warps, and the gate reading a scores buffer
    loses its largest tiles in :func:`prune_gate_configs`.
    """
    cfgs = []
    # decode-like tiles: short token tiles, streaming addresses with wide d blocks
    for bn in (16, 32, 64):
        for bd in (128, 256):
            for stages in (3, 4):
                if (bn, bd, stages) == (16, 256, 3):  # spills 16 bytes in the partial mode
                    continue
                cfgs.append(
                    triton.Config({"BLOCK_T": 16, "BLOCK_N": bn, "BLOCK_D": bd, "BLOCK_O": 64}, num_warps=4, num_stages=stages)
                )
    for bt, bn, bo, w in ((32, 32, 128, 4), (32, 64, 64, 4), (64, 32, 64, 4), (64, 64, 64, 8)):
        cfgs.append(triton.Config({"BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_D": 128, "BLOCK_O": bo}, num_warps=w, num_stages=3))
    # prefill-like tiles
    for bt, bn, bo, w in ((64, 64, 64, 4), (64, 128, 64, 8), (128, 32, 64, 8), (128, 64, 64, 8), (128, 128, 32, 8)):
        cfgs.append(triton.Config({"BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_D": 64, "BLOCK_O": bo}, num_warps=w, num_stages=3))
    return cfgs


def prune_gate_configs(configs: list, named_args: dict, **kwargs) -> list:
    """Drop configurations whose token tile is much taller than the token count (``early_config_prune``).

    Reading scores (``FROM_SCORES``), tiles of more than 4,096 (token, edit)
    pairs spill registers in the sm_90 compile, so they are dropped as well;
    writing d_out slices (``O_SLICED``), so are token tiles over 32.
    """
    bucket = int(named_args["t_bucket"])
    limit = max(16, bucket)
    kept = [c for c in configs if c.kwargs["BLOCK_T"] <= limit]
    if kwargs.get("FROM_SCORES", False):
        kept = [c for c in kept if c.kwargs["BLOCK_T"] * c.kwargs["BLOCK_N"] <= _SCORES_TILE_MAX]
    if kwargs.get("O_SLICED", False):  # decode tiles: the tall ones spill with the slice bounds live
        kept = [c for c in kept if c.kwargs["BLOCK_T"] <= _O_SLICED_MAX_T] or kept
    if bucket >= 256:  # many tokens: skip the decode-only tiles
        kept = [c for c in kept if c.kwargs["BLOCK_T"] >= 64] or kept
    return kept or configs


def scores_configs() -> list:
    """Autotuning space of the phase-A scores kernel."""
    cfgs = []
    # (128, 128) tiles take BLOCK_D 32: with 64 they spill in the sm_90 compile.
    for bt, bn, bd, w in (
        (16, 16, 256, 4),
        (16, 32, 128, 4),
        (16, 64, 128, 4),
        (32, 64, 128, 4),
        (64, 64, 64, 4),
        (128, 64, 64, 8),
        (64, 128, 64, 8),
        (128, 128, 32, 8),
    ):
        cfgs.append(triton.Config({"BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_D": bd}, num_warps=w, num_stages=3))
    # narrow-N, wide-D tiles with deeper pipelines: the split-K phase A of decode
    for bn in (16, 32):
        cfgs.append(triton.Config({"BLOCK_T": 16, "BLOCK_N": bn, "BLOCK_D": 256}, num_warps=4, num_stages=4))
    return cfgs
