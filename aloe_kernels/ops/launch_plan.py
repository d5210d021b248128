"""Host-side launch planning of the fused gate kernels: mode, edit split, blocks, autotuning.

Everything here is decided from shapes, dtypes and the SM count only (no
``.item()``, no host synchronisation), so a launch is safe under CUDA graphs.

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
"""

from __future__ import annotations

import functools
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
    "plan_launch",
    "prune_gate_configs",
    "resolve_blocks",
    "scores_configs",
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


def sm_count(device: torch.device) -> int:
    """SMs of a CUDA device (cached); :data:`INTERPRETER_SMS` elsewhere."""
    if device.type == "cuda":
        return _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    return INTERPRETER_SMS


def t_bucket(T: int) -> int:
    """Token count rounded up to a power of two (at most 8192): the autotuning key, not T itself."""
    return min(1 << max(0, (T - 1).bit_length()), 8192)


def plan_launch(T: int, n: int, d_out: int, y_dtype: torch.dtype, deterministic: bool,
                n_sms: int, split: int = 0) -> GatePlan:
    """Pick mode and edit split from shapes, dtypes and the SM count only (graph safe)."""
    if split <= 0:
        token_tiles = -(-T // 64)
        split = max(1, min(-(-n // _EDIT_GRAIN), -(-4 * n_sms // token_tiles)))
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
    launches = 2 if mode == MODE_PARTIAL else 1
    return GatePlan(mode=mode, split=split, edits_per_split=per, launches=launches)


def _fixed_blocks(T: int, interpret: bool) -> dict:
    if interpret:
        return dict(INTERPRETER_BLOCKS)
    bt = 16 if T <= 16 else 32 if T <= 32 else 64 if T <= 1024 else 128
    return {"block_t": bt, "block_n": 64, "block_d": 128 if bt <= 64 else 64, "block_o": 128}


def resolve_blocks(T: int, interpret: bool, block_t: int, block_n: int, block_d: int, block_o: int) -> dict:
    """Block sizes of an untuned launch: the fixed ones for T, overridden by any given (> 0, powers of two)."""
    base = _fixed_blocks(T, interpret)
    given = {"block_t": block_t, "block_n": block_n, "block_d": block_d, "block_o": block_o}
    for k, v in given.items():
        if v and v > 0:
            if v & (v - 1):
                raise ValueError(f"{k} must be a power of two, got {v}")
            base[k] = int(v)
    return base


def block_meta(blocks: dict) -> dict:
    """The kernel's BLOCK_* constexprs for resolved ``blocks``."""
    return {"BLOCK_T": blocks["block_t"], "BLOCK_N": blocks["block_n"],
            "BLOCK_D": blocks["block_d"], "BLOCK_O": blocks["block_o"]}


def launch_params(blocks: dict, T: int, interpret: bool) -> dict:
    """num_warps / num_stages of an untuned launch (the interpreter takes none)."""
    if interpret:
        return {}
    bt = blocks["block_t"]
    return {"num_warps": 8 if bt >= 128 else 4, "num_stages": 3}


# --------------------------------------------------------------------------
# Autotuning configurations (CUDA only).
# --------------------------------------------------------------------------


def gate_configs() -> list:
    """Autotuning space of the gate kernel: decode-like and prefill-like tiles."""
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


def prune_gate_configs(configs: list, named_args: dict, **kwargs) -> list:
    """Drop configurations whose token tile is much taller than the token count (``early_config_prune``)."""
    bucket = int(named_args["t_bucket"])
    limit = max(16, bucket)
    kept = [c for c in configs if c.kwargs["BLOCK_T"] <= limit]
    if bucket >= 256:  # many tokens: skip the decode-only tiles
        kept = [c for c in kept if c.kwargs["BLOCK_T"] >= 64] or kept
    return kept or configs


def scores_configs() -> list:
    """Autotuning space of the phase-A scores kernel."""
    cfgs = []
    for bt, bn, bd, w in ((16, 16, 256, 4), (16, 32, 128, 4), (16, 64, 128, 4), (32, 64, 128, 4),
                          (64, 64, 64, 4), (128, 64, 64, 8), (64, 128, 64, 8), (128, 128, 64, 8)):
        cfgs.append(triton.Config({"BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_D": bd}, num_warps=w, num_stages=3))
    return cfgs
