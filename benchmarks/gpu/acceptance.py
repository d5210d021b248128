"""``acceptance`` part: the independent check ``scratch/acceptance.py`` (a copy of
``../shared/gpu/acceptance.py``, public API only), its output kept verbatim.

Its three sub-parts (correct, graph, time) run as separate processes and each
writes ``acceptance_<sub>.txt``; ``acceptance.txt`` is rebuilt from whichever
of those exist, so the sub-parts can be spread over several device calls
(``--acceptance-parts time``) and still end in one file to commit.
"""

from __future__ import annotations

import os
import sys

from .common import SCRATCH, Context, PartResult, run_process

SCRIPT = SCRATCH / "acceptance.py"
SUBPARTS = ("correct", "graph", "time")
TIMEOUT_S = 560


def run_sub(ctx: Context, sub: str) -> tuple[int, str, float]:
    """One sub-part of the script in a subprocess (cwd = repository root, as it expects)."""
    cmd = [sys.executable, str(SCRIPT), "--part", sub] + (["--smoke"] if ctx.smoke else [])
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TRITON_INTERPRET", None)  # the script sets it itself for --smoke; on a GPU it must be off
    return run_process(cmd, env, TIMEOUT_S)


def run(ctx: Context, subparts: tuple[str, ...] = SUBPARTS) -> PartResult:
    """The ``acceptance`` part."""
    res = PartResult("acceptance")
    if not SCRIPT.is_file():
        res.status = "skipped"
        res.log(
            f"SKIP: {SCRIPT} missing; run `python -m benchmarks.gpu_suite --prepare` (copies "
            "../shared/gpu/acceptance.py) before the GPU call"
        )
        return res
    ctx.out.mkdir(parents=True, exist_ok=True)
    summaries = []
    for sub in subparts:
        rc, text, seconds = run_sub(ctx, sub)
        header = (
            f"# acceptance.py --part {sub}{' --smoke' if ctx.smoke else ''} on {ctx.env.get('device_name')}; "
            f"torch {ctx.env.get('torch')}, triton {ctx.env.get('triton')}, CUDA {ctx.env.get('cuda')}; "
            f"{ctx.env.get('timestamp_utc')}; rc={rc}; {seconds:.0f} s\n"
        )
        (ctx.out / f"acceptance_{sub}.txt").write_text(header + text)
        last = [ln for ln in text.splitlines() if ln.startswith("SUMMARY")]
        summaries.append(f"{sub}: rc={rc} {last[-1] if last else '(no SUMMARY line)'}")
        res.log(summaries[-1])
        res.data[sub] = {"rc": rc, "seconds": seconds, "fail_lines": [ln for ln in text.splitlines() if ln.startswith("FAIL")]}
        if rc != 0:
            res.status = "fail"
    parts = [ctx.out / f"acceptance_{s}.txt" for s in SUBPARTS if (ctx.out / f"acceptance_{s}.txt").is_file()]
    combined = ctx.out / "acceptance.txt"
    combined.write_text("".join(p.read_text() + "\n" for p in parts))
    res.files.append(str(combined))
    res.data["summary"] = " | ".join(summaries)
    return res
