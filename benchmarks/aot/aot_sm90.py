"""Ahead-of-time compilation of the fused gate kernels for Hopper (sm_90), without a GPU.

Every configuration the launcher can pick (the autotuning spaces of the gate
and scores kernels as pruned for each gate variant, the fixed ones of
deterministic mode, explicit launches and fp32 inputs, the reduction) is
lowered to a cubin with Triton's bundled ptxas, specialised as Triton's
launcher specialises a contiguous launch (``UNIT_STRIDES``, ``DIV16``);
registers, spills and shared memory come from ``ptxas -v`` on the generated
PTX and from the kernel metadata, the count of cp.async copies from the
TTGIR. Writes a markdown table (from the repository root, with the Triton of
the GPU machine, 3.6)::

    TRITON_INTERPRET=0 python -m benchmarks.aot.aot_sm90 [--out benchmarks/results/gpu/aot_sm90.md]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "gpu" / "aot_sm90.md"
FLOATS = ("eps", "gate_eps", "inv_one_minus_geps")
# What Triton's launcher specialises in an ordinary launch (contiguous bf16 tensors from the
# torch allocator, d = 14336, d_out = 4096): unit strides become the constant 1 and 16-aligned
# pointers / multiples of 16 get tt.divisibility=16. Without these the inner loads are not
# vectorised (2-byte accesses), cp.async cannot be used, no loop is software-pipelined and the
# register counts are those of a kernel that never runs.
UNIT_STRIDES = ("stride_hd", "stride_ad", "stride_wo", "stride_oo", "stride_thr", "stride_temp", "stride_on", "stride_yo")
DIV16 = (
    "d",
    "d_out",
    "edits_per_split",
    "d_per_split",
    "o_per_split",
    "stride_ht",
    "stride_an",
    "stride_wn",
    "stride_ot",
    "stride_ws",
    "stride_wt",
    "stride_yt",
)
# (mode, y dtype, input dtype, FROM_SCORES, SCALED_NORM, O_SLICED, name) of the gate variants compiled. 16-bit
# inputs get the autotuning space and the fixed tiles; fp32 inputs only ever launch the fixed fp32
# tiles (``_wide_tiles`` in aloe_gate.py).
GATE_VARIANTS = (
    (1, "fp32", "bf16", False, False, False, "atomic"),
    (2, "fp32", "bf16", False, False, False, "partial"),
    (2, "fp32", "bf16", True, True, False, "partial split-K B"),
    (2, "fp32", "bf16", True, True, True, "partial split-K B, d_out slices"),
    (1, "fp32", "bf16", True, True, True, "atomic split-K B, d_out slices"),
    (0, "fp32", "bf16", False, False, False, "direct"),
    (1, "fp32", "fp32", False, False, False, "atomic"),
    (2, "fp32", "fp32", False, False, False, "partial"),
    (2, "fp32", "fp32", True, True, False, "partial split-K B"),
    (2, "fp32", "fp32", True, True, True, "partial split-K B, d_out slices"),
    (0, "fp32", "fp32", False, False, False, "direct"),
)
FIXED_T = (1, 32, 64, 2048)  # one token count per fixed tile height


def kernel_signature(fn, ptrs: dict, consts: dict) -> dict:
    """Triton compile signature of a jitted kernel: constexprs, the given pointer types, fp32 scalars in
    FLOATS, i32 for every other scalar (shared with the sm_90 compile test)."""
    sig = {}
    for arg in fn.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            sig[arg] = ptrs[arg]
        else:
            sig[arg] = "fp32" if arg in FLOATS else "i32"
    return sig


def _specialise(fn, consts: dict) -> tuple:
    """(constexprs with the unit strides, tt.divisibility attrs) of an ordinary launch (see ``UNIT_STRIDES``)."""
    from_scores = consts.get("FROM_SCORES", False)
    consts = {**consts, **{a: 1 for a in UNIT_STRIDES if a in fn.arg_names}}
    # The split-K scores buffer (k, T, n + 2) has rows of n + 2 values: no divisibility to rely on.
    div = [
        a
        for a in fn.arg_names
        if a not in consts and (a.endswith("_ptr") or a in DIV16) and not (from_scores and a in ("stride_ht", "stride_an"))
    ]
    return consts, {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div}


def _ptxas_stats(ptx: str, ptxas: str) -> tuple:
    """(registers, spill bytes) of the PTX's kernel, from ``ptxas -v``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run(
            [ptxas, "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
            capture_output=True,
            text=True,
            check=True,
        )
    text = res.stderr + res.stdout
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return regs, max(spills or [0])


def _fixed(wide: bool) -> list:
    """(constexprs, warps, stages, "fixed") of the distinct fixed configurations."""
    from aloe_kernels.ops.launch_plan import _fixed_blocks, block_meta, launch_params

    out = []
    for T in FIXED_T:
        blocks = _fixed_blocks(T, False, wide)
        lp = launch_params(blocks, T, False)
        row = (block_meta(blocks), lp["num_warps"], lp["num_stages"], "fixed")
        if row not in out:
            out.append(row)
    return out


def _gate_rows() -> list:
    """(kernel, mode, dtype, ptrs, constexprs, warps, stages) of every compiled gate configuration."""
    from aloe_kernels.ops.launch_plan import gate_configs, prune_gate_configs

    rows = []
    for mode, ydt, dt, from_scores, scaled, sliced, name in GATE_VARIANTS:
        # only what the autotuner can pick: reading scores, the big tiles are pruned
        cfgs = prune_gate_configs(gate_configs(), {"t_bucket": 128}, FROM_SCORES=from_scores, O_SLICED=sliced)
        tuned = [(c.kwargs, c.num_warps, c.num_stages, "autotune") for c in cfgs]
        src = "fp32" if from_scores else dt
        ptrs = {
            "h_ptr": f"*{src}",
            "a_ptr": f"*{src if from_scores else dt}",
            "thr_ptr": "*fp32",
            "temp_ptr": "*fp32",
            "w_ptr": f"*{dt}",
            "out_ptr": f"*{ydt}",
            "flag_ptr": "*i32",
        }
        # d_out slices are automatic only up to 32 tokens (launch_plan._O_SLICED_MAX_T): decode tiles
        fixed = [f for f in _fixed(dt == "fp32") if not sliced or f[0]["BLOCK_T"] <= 32]
        for meta, warps, stages, kind in fixed + (tuned if dt == "bf16" else []):
            consts = {
                "MODE": mode,
                "FROM_SCORES": from_scores,
                "SCALED_NORM": scaled,
                "CAST_SCORES": False,
                "CAST_WRITES": dt == "fp32",
                "DOT_PREC": "ieee",
                "O_SLICED": sliced,
                **meta,
            }
            rows.append(("gate", f"{name} ({kind})", dt, ptrs, consts, warps, stages))
    return rows


def _other_rows() -> list:
    from aloe_kernels.ops.launch_plan import reduce_blocks, scores_configs

    rows = []
    for T, s, d_out in ((1, 82, 4096), (16, 64, 4096), (2048, 2, 4096)):
        rows.append(
            (
                "reduce",
                f"T={T} S={s}",
                "bf16",
                {"ws_ptr": "*fp32", "flag_ptr": "*i32", "y_ptr": "*bf16"},
                reduce_blocks(T, s, d_out),
                4,
                1,
            )
        )
    tuned = [(c.kwargs, c.num_warps, c.num_stages, "autotune") for c in scores_configs()]
    for dt in ("bf16", "fp32"):
        ptrs = {"h_ptr": f"*{dt}", "a_ptr": f"*{dt}", "out_ptr": "*fp32"}
        # the TP phase A (SCALED_NORM=False) differs only in its norm store
        for meta, warps, stages, kind in _fixed(dt == "fp32") + (tuned if dt == "bf16" else []):
            meta = {k: v for k, v in meta.items() if k != "BLOCK_O"}
            consts = {"SCALED_NORM": True, "CAST_SCORES": False, "DOT_PREC": "ieee", **meta}
            rows.append(("scores", f"split-K A ({kind})", dt, ptrs, consts, warps, stages))
    return rows


def start(doc: str, default_out: Path) -> Path:
    """The ``--out`` of an ahead-of-time script; refuses the interpreter (interpreted Triton cannot
    compile) and puts the repository root on ``sys.path``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=0: interpreted Triton cannot compile")
    sys.path.insert(0, str(ROOT))
    return args.out


def main() -> None:
    out = start(__doc__, OUT)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from aloe_kernels.ops.gate_kernels import jit_kernels

    kernels = jit_kernels(False)
    target = GPUTarget("cuda", 90, 32)
    ptxas = get_ptxas(90).path
    lines = []
    t0 = time.time()
    for kname, mode, dt, ptrs, consts, warps, stages in _gate_rows() + _other_rows():
        fn = kernels[kname]
        blocks = ", ".join(f"{k[6:]}={v}" for k, v in consts.items() if k.startswith("BLOCK_"))
        consts, attrs = _specialise(fn, consts)
        cx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
        src = ASTSource(fn=fn, signature=kernel_signature(fn, ptrs, consts), constexprs=cx, attrs=attrs)
        try:
            k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
            regs, spills = _ptxas_stats(k.asm["ptx"], ptxas)
            copies = k.asm["ttgir"].count("ttg.async_copy_global_to_local")
            cells = [str(regs), str(spills), str(int(k.metadata.shared)), str(copies)]
        except Exception as exc:  # reported in the table
            cells = ["error", "", f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}", ""]
        lines.append(f"| {kname} | {mode} | {dt} | {blocks} | {warps} | {stages} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    _write(out, triton.__version__, lines, time.time() - t0)


NOTES = """\
Notes:

- Specialisation. Each kernel is compiled the way Triton's launcher specialises an ordinary launch
  (`UNIT_STRIDES`, `DIV16` in the script): contiguous tensors, so the inner strides are the constant
  1, and 16-byte aligned pointers and multiples of 16 (d = 14336, d_out = 4096, row strides) carry
  `tt.divisibility=16`. The first version of this table compiled every stride as a plain i32: 33 of
  77 configurations spilled (12-864 bytes on the bf16 gate tiles with BLOCK_N = 64, 2.8-65 KB on the
  fixed fp32 direct path) and 3 and 4 stages gave the same shared memory. h with a column stride
  other than 1 (allowed by the op) still compiles to that slower, unpipelined kernel.
- Pipelining. Nothing was pipelined in the unspecialised compile: without a unit stride the loads
  are 2-byte scalar loads, which the software pipeliner does not turn into cp.async (it needs 4, 8
  or 16-byte copies), so the loads stayed in registers and every tile was staged through shared
  memory once. Specialised, every loop is pipelined, the nested d loop inside the edit-chunk loop
  and the d_out write loop included: `async copies` counts the `ttg.async_copy_global_to_local` ops
  in the TTGIR, and shared memory grows with the stages (e.g. T=16, N=64, D=128: 40,960 bytes at 3
  stages, 61,440 at 4). No change to the kernel was needed.
- Configurations changed so that none spills (`launch_plan.py`):
  decode tiles (T=16) write with BLOCK_O 64 instead of 128 (two spilled 8 bytes with 128);
  T=16, N=16, D=256 at 3 stages dropped (16 bytes in the partial mode; the 4-stage one stays);
  T=32, N=64 writes with BLOCK_O 64 (4-84 bytes with 128);
  T=64 tiles: N=32 with BLOCK_O 64, N=64 with BLOCK_O 64 and 8 warps (4 warps spilled 84-316
  bytes); prefill tiles write with BLOCK_O 64 (128: 4-584 bytes), T=128, N=128 with BLOCK_O 32,
  and T=128, N=32 added. The gate reading a scores buffer (split-K phase B, tensor-parallel phase
  B) spills above 64 x 64 (token, edit) tiles, so `prune_gate_configs` drops those there.
  Scores: T=128, N=128 takes BLOCK_D 32 (64 spilled 72 bytes).
- d_out slices (`O_SLICED`, a constexpr): the gate reading scores writes one slice of d_out per
  program only at decode (at most 32 tokens). With the slice bounds live, its T=64, N=32 and
  T=128, N=32 tiles spilled 4-12 bytes, and so did the unsliced T=16, N=32, D=128 partial tile
  while the bounds were runtime values in every kernel. So the bounds are compile-time 0 and d_out
  when not slicing, and `prune_gate_configs` keeps sliced tiles at most 32 tokens tall. An explicit
  `o_split` at more tokens can still launch those tiles.
- Fixed configurations (deterministic mode, explicit launches, fp32 inputs): 16-bit inputs
  T=16: N=64, D=128, O=128; T=32: N=32, D=128, O=128; T=64: N=64, D=128, O=64, 8 warps;
  T=128: N=32, D=64, O=64, 8 warps. fp32 inputs, which never autotune (the tuning space is
  sized for 16-bit tiles): T=16: N=32, D=64, O=64 up to 1,024 tokens, T=128: N=16, D=32, O=32.
"""


def _write(path: Path, version: str, lines: list, seconds: float) -> None:
    spilled = [ln for ln in lines if ln.split("|")[8].strip() not in ("0", "")]
    head = [
        "# Fused gate kernels compiled ahead of time for sm_90 (H100)",
        "",
        f'Triton {version}, target `GPUTarget("cuda", 90, 32)`, no GPU needed ({len(lines)} configurations, '
        f"{seconds:.0f} s). Command, from the repository root with Triton {version} installed (the "
        "interpreter must be off):",
        "",
        "    TRITON_INTERPRET=0 python -m benchmarks.aot.aot_sm90",
        "",
        "Registers and spill bytes from the bundled `ptxas -v` on the generated PTX; shared memory from the",
        "kernel metadata (bytes per block; sm_90 allows 232,448). Gate inputs are bf16 or fp32 as listed,",
        "thresholds/temperatures fp32; `split-K B` is the gate reading the split-K scores buffer. `fixed`:",
        "the configurations of deterministic mode, explicit launches and fp32 inputs; `autotune`: the",
        "autotuning space (16-bit inputs only).",
        "",
        NOTES,
        f"Configurations with spills: {len(spilled)}." + ("" if not spilled else " Listed first below."),
        "",
        "| kernel | mode | dtype | blocks | warps | stages | registers | spill bytes | shared bytes | async copies |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(head + spilled + [ln for ln in lines if ln not in spilled]) + "\n")


if __name__ == "__main__":
    main()
