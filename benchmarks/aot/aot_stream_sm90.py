"""Ahead-of-time compilation of the streaming decode kernels (S + W) for Hopper (sm_90), without a GPU.

For each configuration: registers and spills (``ptxas -v``), shared memory, and what the compiled
streaming loop of S does every step: the width of its ``cp.async`` copies, whether its product is
``wgmma`` or ``mma.sync``, and the divisions, shuffles and barriers on the path every step takes
(the loop's blocks that dominate its back edge, from the PTX's control-flow graph; the blocks of
the conditional segment store are excluded and counted apart). Bytes in flight per SM: the
shared memory of the one program per SM less the one step's tiles being read (the pipeline's
buffers hold the steps requested ahead). Writes a
markdown table (from the repository root, with the Triton of the GPU machine, 3.6)::

    TRITON_INTERPRET=0 python -m benchmarks.aot.aot_stream_sm90 [--out benchmarks/results/gpu/aot_stream_sm90.md]
"""

from __future__ import annotations

import itertools
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "benchmarks" / "results" / "gpu" / "aot_stream_sm90.md"
BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# What an ordinary launch specialises (contiguous tensors, 16-aligned, d = 14336, d_out = 4096).
S_UNIT = ("stride_hd", "stride_ad", "stride_thr", "stride_temp")
S_DIV16 = ("d", "stride_ht", "stride_an", "stride_qs")
W_UNIT = ("stride_wo", "stride_yo")
W_DIV16 = ("d_out", "stride_wn", "stride_yt")


# ------------------------------------------------------------------ PTX control flow
def ptx_blocks(ptx: str) -> tuple[list, dict]:
    """Basic blocks of the PTX's kernel body: (blocks as lists of lines, successors by block index)."""
    body = ptx[ptx.index("{", ptx.index(".entry")) + 1 :].splitlines()
    blocks, names, cur = [], {}, []
    for line in body:
        label = re.match(r"^(\$L__BB\d+_\d+):", line)
        if label:
            if cur:
                blocks.append(cur)
            cur = []
            names[label.group(1)] = len(blocks)
            continue
        cur.append(line)
        if re.search(r"\bbra(\.uni)?\b|\bret;", line):
            blocks.append(cur)
            cur = []
    if cur:
        blocks.append(cur)
    succ = {}
    for i, b in enumerate(blocks):
        last = b[-1] if b else ""
        target = re.search(r"bra(?:\.uni)?\s+(\$L__BB\d+_\d+)", last)
        out = [names[target.group(1)]] if target else []
        conditional = last.strip().startswith("@")
        if (not target or conditional) and "ret;" not in last and i + 1 < len(blocks):
            out.append(i + 1)
        succ[i] = out
    return blocks, succ


def _dominators(n: int, succ: dict) -> list:
    preds = {i: [j for j in range(n) if i in succ[j]] for i in range(n)}
    dom = [set(range(n)) for _ in range(n)]
    dom[0] = {0}
    changed = True
    while changed:
        changed = False
        for i in range(1, n):
            new = {i} | (set.intersection(*(dom[p] for p in preds[i])) if preds[i] else set())
            if new != dom[i]:
                dom[i], changed = new, True
    return dom


def streaming_loop(ptx: str) -> tuple[list, list]:
    """(lines every step runs, lines of the loop's conditional blocks) of the loop holding the cp.async copies."""
    blocks, succ = ptx_blocks(ptx)
    dom = _dominators(len(blocks), succ)
    best = None
    for latch, outs in succ.items():
        for header in outs:
            if header in dom[latch]:  # a back edge: its natural loop
                body, stack = {header, latch}, [latch]
                while stack:
                    b = stack.pop()
                    for p in (j for j in range(len(blocks)) if b in succ[j]):
                        if p not in body:
                            body.add(p)
                            stack.append(p)
                copies = sum("cp.async" in ln for b in body for ln in blocks[b])
                if copies and (best is None or len(body) < len(best[0])):
                    best = (body, latch)
    if best is None:
        return [], []
    body, latch = best
    every = [ln for b in sorted(body) if b in dom[latch] for ln in blocks[b]]
    sometimes = [ln for b in sorted(body) if b not in dom[latch] for ln in blocks[b]]
    return every, sometimes


def loop_counts(lines: list) -> dict:
    text = "\n".join(lines)
    widths = sorted({int(w, 0) for w in re.findall(r"cp\.async\.c[ag]\.shared\.global \[[^]]*\], \[[^]]*\], (\w+)", text)})
    return {
        "cp.async": f"{text.count('cp.async.c')}x{'/'.join(map(str, widths)) or '-'}B",
        "mma": "wgmma" if "wgmma.mma_async" in text else "mma.sync" if "mma.sync" in text else "fma",
        "div": len(re.findall(r"\b(?:div|rcp)\.", text)),
        "shfl": text.count("shfl.sync"),
        "bar": len(re.findall(r"\bbar(?:rier)?\.sync\b|\bbar\.arrive\b", text)),
    }


# ------------------------------------------------------------------ configurations
def _s_rows() -> list:
    rows = []
    for dt in ("bf16", "fp32"):
        space = (
            itertools.product((16, 32), (64, 128), (64, 128), (4, 8), (3, 4))
            if dt == "bf16"
            else itertools.product((16, 32), (32, 64), (32, 64, 128), (4,), (3, 4))
        )
        for bt, bn, bd, warps, stages in space:
            if warps == 8 and bn == 64:
                continue  # 8 warps need 128 edit rows (two warpgroups of 64)
            rows.append(_s_row(dt, dt, 0, bt, bn, bd, warps, stages))
    # The int8 screen (MODE 1, one 128-column scale group a step) and the rescoring of the kept rows
    # (MODE 2), at the default tiles.
    for bt in (16, 32):
        rows.append(_s_row("bf16", "i8", 1, bt, 64, 128, 4, 6))  # stream_gate._GPU_SCREEN_STAGES
        rows.append(_s_row("bf16", "bf16", 2, bt, 64, 128, 4, 4))
    return rows


def _s_row(dt: str, adt: str, mode: int, bt: int, bn: int, bd: int, warps: int, stages: int) -> tuple:
    """One configuration of kernel S: state dtype, address dtype (``i8`` for the screen), mode, tiles."""
    ptrs = {"h_ptr": f"*{dt}", "a_ptr": f"*{adt}", "thr_ptr": "*fp32", "temp_ptr": "*fp32", "part_ptr": "*fp32"}
    ptrs.update({"sq_ptr": "*fp64", "ticket_ptr": "*i32", "flag_ptr": "*i32", "gate_ptr": "*fp32", "perm_ptr": "*i32"})
    ptrs.update({"qs_ptr": "*fp16", "lim_ptr": "*fp32", "keep_ptr": "*i32", "kblk_ptr": "*i32"})
    consts = {"MODE": mode, "PERMUTED": False, "CAST": False, "DOT_PREC": "ieee", "USE_PDL": True}
    consts.update({"BLOCK_T": bt, "BLOCK_N": bn, "BLOCK_D": bd})
    tile = bn * bd * (1 if adt == "i8" else BYTES[adt]) + bd * bt * BYTES[dt]  # one step's address + state bytes
    label = {0: dt, 1: f"{dt}, int8 screen", 2: f"{dt}, rescore kept"}[mode]
    return ("scores", label, ptrs, consts, warps, stages, tile, S_UNIT, S_DIV16)


def _w_rows() -> list:
    rows = []
    for dt, ydt in (("bf16", "bf16"), ("bf16", "fp32"), ("fp32", "fp32")):
        for bt, bo in itertools.product((16, 32), (64, 128) if dt == "bf16" else (16, 32, 64)):
            ptrs = {"flag_ptr": "*i32", "gate_ptr": "*fp32", "w_ptr": f"*{dt}", "y_ptr": f"*{ydt}"}
            consts = {
                "CAST_WRITES": dt == "fp32",
                "DOT_PREC": "ieee",
                "USE_PDL": True,
                "BLOCK_T": bt,
                "BLOCK_N": 64,
                "BLOCK_O": bo,
                "BLOCK_F": 32,
            }
            rows.append(("write", f"{dt} -> {ydt}", ptrs, consts, 4, 1, 0, W_UNIT, W_DIV16))
    return rows


def _default_marks() -> set:
    """(kernel, dtype, blocks...) of what the launcher picks on a GPU for one and for 32 tokens."""
    from aloe_kernels.int8_format import GROUP
    from aloe_kernels.ops import stream_gate as sg

    marks = set()
    for bt in (1, 32):
        for dt in ("bf16", "fp32"):
            wide = dt == "fp32"
            b = sg.stream_blocks(bt, False, fp32_scores=wide, fp32_writes=wide)
            marks.add(("scores", dt, b["block_t"], b["block_n"], b["block_d"], sg._GPU_WARPS, sg._GPU_STAGES))
            marks.add(("write", dt, b["block_t"], b["block_o"]))
        # with an int8 screen: its pass, then the rescoring of the kept rows at the plain tiles
        b = sg.stream_blocks(bt, False)
        marks.add(("scores", "bf16, int8 screen", b["block_t"], b["block_n"], GROUP, sg._GPU_WARPS, sg._GPU_SCREEN_STAGES))
        marks.add(("scores", "bf16, rescore kept", b["block_t"], b["block_n"], b["block_d"], sg._GPU_WARPS, sg._GPU_STAGES))
    return marks


def compile_config(kernels: dict, row: tuple) -> dict:
    """Compile one configuration for sm_90; its registers, spills, shared memory and loop counts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource

    from benchmarks.aot.aot_sm90 import _ptxas_stats, kernel_signature

    kname, dt, ptrs, consts, warps, stages, _, unit, div16 = row
    fn = kernels[kname]
    cx_all = {**consts, **{a: 1 for a in unit}}
    attrs = {
        (fn.arg_names.index(a),): [["tt.divisibility", 16]]
        for a in fn.arg_names
        if a not in cx_all and (a.endswith("_ptr") or a in div16)
    }
    cx = {(fn.arg_names.index(k),): v for k, v in cx_all.items()}
    src = ASTSource(fn=fn, signature=kernel_signature(fn, ptrs, cx_all), constexprs=cx, attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    regs, spills = _ptxas_stats(ptx, get_ptxas(90).path)
    every, sometimes = streaming_loop(ptx) if kname == "scores" else ([], [])
    return {
        "registers": regs,
        "spills": spills,
        "shared": int(k.metadata.shared),
        "step": loop_counts(every),
        "segment_end": loop_counts(sometimes),
        "product": loop_counts(ptx.splitlines())["mma"],
    }


def default_rows() -> list:
    """The configurations the launcher picks on a GPU (``default`` in the table)."""
    marks = _default_marks()
    return [r for r in _s_rows() + _w_rows() if _row_key(r) in marks]


def _row_key(row: tuple) -> tuple:
    kname, dt, _, c, warps, stages = row[:6]
    if kname == "scores":
        return ("scores", dt, c["BLOCK_T"], c["BLOCK_N"], c["BLOCK_D"], warps, stages)
    return ("write", dt.split()[0], c["BLOCK_T"], c["BLOCK_O"])


def main() -> None:
    sys.path.insert(0, str(ROOT))
    from benchmarks.aot.aot_sm90 import start

    out = start(__doc__, OUT)
    import triton

    from aloe_kernels.ops.stream_kernels import jit_stream_kernels

    kernels = jit_stream_kernels(False)
    marks = _default_marks()
    lines, t0 = [], time.time()
    for row in _s_rows() + _w_rows():
        kname, dt, _, consts, warps, stages, tile = row[:7]
        blocks = ", ".join(f"{k[6:]}={v}" for k, v in consts.items() if k.startswith("BLOCK_"))
        default = "yes" if _row_key(row) in marks else ""
        try:
            r = compile_config(kernels, row)
            cells = [str(r["registers"]), str(r["spills"]), str(r["shared"])]
            if kname == "scores":
                c, cs = r["step"], r["segment_end"]
                cells += [
                    c["cp.async"],
                    r["product"],
                    f"{c['div']}/{c['shfl']}/{c['bar']}",
                    f"{cs['div']}/{cs['shfl']}/{cs['bar']}",
                    f"{max(0, r['shared'] - tile) // 1024} KB",
                ]
            else:
                cells += ["", r["product"], "", "", ""]
        except Exception as exc:  # reported in the table
            cells = ["error", "", f"{type(exc).__name__}: {str(exc).splitlines()[0][:80]}", "", "", "", "", ""]
        lines.append(f"| {kname} | {dt} | {blocks} | {warps} | {stages} | {default} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    _write(out, triton.__version__, lines, time.time() - t0)


def _write(path: Path, version: str, lines: list, seconds: float) -> None:
    head = [
        "# Streaming decode kernels (S + W) compiled ahead of time for sm_90",
        "",
        f'Triton {version}, target `GPUTarget("cuda", 90, 32)`, no GPU needed ({len(lines)} configurations, '
        f"{seconds:.0f} s). Command, from the repository root with Triton {version} installed:",
        "",
        "    TRITON_INTERPRET=0 python -m benchmarks.aot.aot_stream_sm90",
        "",
        "Launches per call: 2 (S then W; `tests/kernels/test_kernel_stream.py::test_two_launches_per_call`).",
        "`default`: what `aloe_kernels/ops/stream_gate.py` launches on a GPU. `step: div/shfl/bar`: divisions",
        "(div, rcp), warp shuffles and barriers on the path every step of S's streaming loop takes;",
        "`segment end`: the same in the loop's conditional block that stores a segment's partials (once",
        "per edit block a program leaves). `in flight`: shared memory less the step being read (address",
        "and state tiles requested ahead), per SM (one program per SM). Registers and spills from `ptxas -v`, shared",
        "memory in bytes per block (sm_90 allows 232,448). No GPU has run these kernels yet: this table",
        "says how they compile, not how fast they are.",
        "",
        "| kernel | dtype | blocks | warps | stages | default | registers | spill bytes | shared bytes | "
        "cp.async in loop | product | step: div/shfl/bar | segment end: div/shfl/bar | in flight |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(head + lines) + "\n")


if __name__ == "__main__":
    main()
