"""Ahead-of-time compilation of the fused gate kernels for Hopper (sm_90), without a GPU.

Every configuration of the autotuning spaces (gate, scores) and the fixed
ones (deterministic mode, reduction) is lowered to a cubin with Triton's
bundled ptxas; registers, spills and shared memory come from ``ptxas -v`` on
the generated PTX and from the kernel metadata. Writes a markdown table::

    TRITON_INTERPRET=0 python -m benchmarks.aot_sm90 [--out benchmarks/results/gpu/aot_sm90.md]
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

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "results" / "gpu" / "aot_sm90.md"
FLOATS = ("eps", "gate_eps", "inv_one_minus_geps")
# (mode, y dtype, input dtype, FROM_SCORES, SCALED_NORM, name) of the gate variants compiled
GATE_VARIANTS = (
    (1, "fp32", "bf16", False, False, "atomic"),
    (2, "fp32", "bf16", False, False, "partial"),
    (2, "fp32", "bf16", True, True, "partial split-K B"),
    (0, "fp32", "fp32", False, False, "direct"),
)


def _signature(fn, ptrs: dict, consts: dict) -> dict:
    sig = {}
    for arg in fn.arg_names:
        if arg in consts:
            sig[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            sig[arg] = ptrs[arg]
        else:
            sig[arg] = "fp32" if arg in FLOATS else "i32"
    return sig


def _ptxas_stats(ptx: str, ptxas: str) -> tuple:
    """(registers, spill bytes) of the PTX's kernel, from ``ptxas -v``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True)
    text = res.stderr + res.stdout
    regs = int(re.search(r"Used (\d+) registers", text).group(1))
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", text)]
    return regs, max(spills or [0])


def _gate_rows() -> list:
    """(kernel, mode, dtype, ptrs, constexprs, warps, stages) of every compiled gate configuration."""
    from aloe_kernels.ops.launch_plan import _fixed_blocks, block_meta, gate_configs, launch_params

    rows = []
    fixed = []
    for T in (1, 32, 64, 2048):
        blocks = _fixed_blocks(T, False)
        lp = launch_params(blocks, T, False)
        fixed.append((block_meta(blocks), lp["num_warps"], lp["num_stages"], "fixed"))
    tuned = [(c.kwargs, c.num_warps, c.num_stages, "autotune") for c in gate_configs()]
    for mode, ydt, dt, from_scores, scaled, name in GATE_VARIANTS:
        src = "fp32" if from_scores else dt
        ptrs = {"h_ptr": f"*{src}", "a_ptr": f"*{src if from_scores else dt}", "thr_ptr": "*fp32",
                "temp_ptr": "*fp32", "w_ptr": f"*{dt}", "out_ptr": f"*{ydt}", "flag_ptr": "*i32"}
        # The whole autotuning space for the two modes of the fast path; fixed configurations for all.
        for meta, warps, stages, kind in fixed + (tuned if name in ("atomic", "partial") else []):
            consts = {"MODE": mode, "FROM_SCORES": from_scores, "SCALED_NORM": scaled, "CAST_SCORES": False,
                      "CAST_WRITES": dt == "fp32", "DOT_PREC": "ieee", **meta}
            rows.append(("gate", f"{name} ({kind})", dt, ptrs, consts, warps, stages))
    return rows


def _other_rows() -> list:
    from aloe_kernels.ops.launch_plan import reduce_blocks, scores_configs

    rows = []
    for T, s, d_out in ((1, 82, 4096), (16, 64, 4096), (2048, 2, 4096)):
        rows.append(("reduce", f"T={T} S={s}", "bf16", {"ws_ptr": "*fp32", "flag_ptr": "*i32", "y_ptr": "*bf16"},
                     reduce_blocks(T, s, d_out), 4, 1))
    ptrs = {"h_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*fp32"}
    for scaled, name in ((True, "split-K A"),):  # the TP phase A differs only in its norm store
        for c in scores_configs():
            consts = {"SCALED_NORM": scaled, "CAST_SCORES": False, "DOT_PREC": "ieee", **c.kwargs}
            rows.append(("scores", f"{name} (autotune)", "bf16", ptrs, consts, c.num_warps, c.num_stages))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=0: interpreted Triton cannot compile")
    sys.path.insert(0, str(ROOT))
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
        cx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
        src = ASTSource(fn=fn, signature=_signature(fn, ptrs, consts), constexprs=cx)
        blocks = ", ".join(f"{k[6:]}={v}" for k, v in consts.items() if k.startswith("BLOCK_"))
        try:
            k = triton.compile(src, target=target, options={"num_warps": warps, "num_stages": stages})
            regs, spills = _ptxas_stats(k.asm["ptx"], ptxas)
            cells = [str(regs), str(spills), str(int(k.metadata.shared))]
        except Exception as exc:  # reported in the table
            cells = ["error", "", f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}"]
        lines.append(f"| {kname} | {mode} | {dt} | {blocks} | {warps} | {stages} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    _write(args.out, triton.__version__, lines, time.time() - t0)


def _write(path: Path, version: str, lines: list, seconds: float) -> None:
    spilled = [ln for ln in lines if ln.split("|")[8].strip() not in ("0", "")]
    head = [
        "# Fused gate kernels compiled ahead of time for sm_90 (H100)",
        "",
        f"Triton {version}, target `GPUTarget(\"cuda\", 90, 32)`, no GPU needed ({len(lines)} configurations, "
        f"{seconds:.0f} s). Command:",
        "",
        "    TRITON_INTERPRET=0 python -m benchmarks.aot_sm90",
        "",
        "Registers and spill bytes from the bundled `ptxas -v` on the generated PTX; shared memory from the",
        "kernel metadata (bytes per block; sm_90 allows 232,448). Gate inputs are bf16 (fp32 for direct),",
        "thresholds/temperatures fp32; `split-K B` is the gate reading the split-K scores buffer.",
        "",
        f"Configurations with spills: {len(spilled)}." + ("" if not spilled else " Listed first below; the "
                                                          "autotuner should not pick them for production."),
        "",
        "| kernel | mode | dtype | blocks | warps | stages | registers | spill bytes | shared bytes |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(head + spilled + [ln for ln in lines if ln not in spilled]) + "\n")


if __name__ == "__main__":
    main()
