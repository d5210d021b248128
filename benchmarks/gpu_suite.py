"""The GPU suite of issue 16: one command for a lent GPU, no install needed there.

    python3 -m benchmarks.gpu_suite [--part tests|graph|gate|decode|build|smollm2|acceptance|all]
                                    [--smoke] [--out DIR] [--acceptance-parts correct,graph,time]
    python3 -m benchmarks.gpu_suite --prepare     # on the dev machine, before a GPU call
    make gpu-check                                # = python3 -m benchmarks.gpu_suite --part all

Parts (one module each under ``benchmarks/gpu/``):

- ``tests``: the kernel test files under pytest with ``ALOE_TEST_DEVICE=cuda``
  (compiled kernels, no interpreter; fails clearly if pytest is absent);
- ``graph``: CUDA-graph capture and ``torch.compile(fullgraph=True)`` of
  ``aloe_residual_`` and of the HF-patched down-projection, against float64;
- ``gate``: the gate kernel at the Llama-3-8B down-projection (bf16, T 1/16/2048,
  n 1,301/10,000/100,000, sparse gates) against the copy bandwidth measured in the
  run, the unfused formula, shrink+expand and the cuBLAS score GEMM;
- ``decode``: an HF decode step of a random Llama-3-8B-shaped model (static
  cache, CUDA graph), batch 1 and 32, without and with 1,301/10,000/100,000 edits;
- ``build``: ``aloe build --device cuda`` of 1,301 edits on a random model of
  SmolLM2's shape (inputs from ``scratch/``);
- ``smollm2``: the real SmolLM2-135M-Instruct, whose GGUF travels in three parts
  (``.gpu-model/part1..3``, one carried per call, stashed in ``/tmp`` until all
  are there): ``aloe build`` and ``aloe eval`` of the 1,301 edits on the GPU;
- ``acceptance``: ``scratch/acceptance.py`` (independent check), kept as
  ``acceptance.txt``.

Each part writes ``<part>.json`` and ``<part>.txt`` (device, torch/Triton/
transformers/CUDA versions, timestamp) under ``benchmarks/results/gpu/<device>/``
and prints one summary line with PASS/MISS/n/a per target of the issue; a part
that crashes is reported and the rest still run. ``summary.json`` collects the
lines of the run. ``--smoke`` runs every part on CPU with tiny shapes under
TRITON_INTERPRET=1 (set before any kernel import) in well under a minute,
skipping with a reason whatever needs CUDA; it writes to ``$TMPDIR/aloe_gpu_suite_smoke``.

GPU procedure (device time is scarce, at most 10 minutes per call; the machine is
released after 30 s idle, so make the calls back to back):

1. here: ``python -m benchmarks.gpu_suite --prepare`` (fills the untracked
   ``scratch/``: tokenizer, 1,301 edits, acceptance.py; ~4 MiB; and the ignored
   ``.gpu-model/part1..3``, ~32 MiB each) and ``python -m benchmarks.gpu_suite --smoke``;
   for the real model, three calls back to back, each carrying one part
   (``carry: [".gpu-model/part1"]`` ...), each running ``--part smollm2`` after any
   other parts (on the H200 of the second run: build 201 s with the shared negatives
   mined there, 164 s with them cached; evaluation 47 s);
2. on the GPU, back to back (on the H100 of the first run: tests 145 s, graph 45 s,
   gate 30 s, decode 75 s, acceptance correct 190 s / graph 15 s / time 75 s; the build
   of 1,301 edits more than 7 minutes with the encoder untrained; on the H200 of the
   second: gate 56 s, decode 28 s, tests 86 s):
   ``python3 -m benchmarks.gpu_suite --part tests,graph,decode --out /tmp/r``;
   ``--part gate --out /tmp/r`` and ``--part acceptance --out /tmp/r``; ``--part build
   --out /tmp/r``, each command ending with ``tar czf $OUT/r.tgz -C /tmp r``: only
   8 files, at most 2 folders below ``$OUT``, come back from a call, and ``/tmp``
   lasts as long as the machine stays warm;
3. unpack into ``benchmarks/results/gpu/<device>/`` and commit; when the acceptance
   sub-parts ran on different machines, rebuild the file to commit there:
   ``cat acceptance_correct.txt acceptance_graph.txt acceptance_time.txt > acceptance.txt``.

If the image lacks pytest, the ``tests`` part says so; pure-Python pytest (with
pluggy, iniconfig, packaging) put on PYTHONPATH makes it run.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
import traceback
from pathlib import Path

PARTS = ("tests", "graph", "gate", "decode", "build", "smollm2", "acceptance")
MODULES = {
    "tests": "tests_part",
    "graph": "graph",
    "gate": "gate",
    "decode": "decode",
    "build": "build",
    "smollm2": "smollm2",
    "acceptance": "acceptance",
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="gpu_suite", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--part", default="all", help=f"comma-separated parts from {', '.join(PARTS)}, or all (default)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, Triton interpreter (< 1 minute)")
    p.add_argument("--out", default=None, help="results folder (default benchmarks/results/gpu/<device>/)")
    p.add_argument(
        "--acceptance-parts", default="correct,graph,time", help="sub-parts of acceptance.py to run (default all three)"
    )
    p.add_argument("--prepare", action="store_true", help="copy the GPU run's inputs into scratch/ and exit")
    return p.parse_args(argv)


def _parts(spec: str) -> list[str]:
    parts = list(PARTS) if spec == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    unknown = [s for s in parts if s not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)} or all")
    return parts


def run_part(ctx, name: str, args: argparse.Namespace):
    """Run one part; a crash becomes a 'crashed' result with its traceback, never an exit."""
    from benchmarks.gpu.common import PartResult, write_part

    t0 = time.perf_counter()
    print(f"== {name}", flush=True)
    try:
        module = importlib.import_module(f"benchmarks.gpu.{MODULES[name]}")
        if name == "acceptance":
            subs = ("correct",) if ctx.smoke else tuple(s for s in args.acceptance_parts.split(",") if s)
            res = module.run(ctx, subs)
        else:
            res = module.run(ctx)
    except Exception as exc:
        res = PartResult(name, status="crashed")
        res.log(f"CRASHED: {type(exc).__name__}: {str(exc)[:500]}")
        res.data["traceback"] = traceback.format_exc()[-4000:]
    res.seconds = time.perf_counter() - t0
    try:
        write_part(ctx, res)
    except Exception as exc:  # the summary line must still print
        print(f"  could not write {name} results: {exc!r}")
    if ctx.cuda:
        import torch

        torch.cuda.empty_cache()
    return res


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the chosen parts, print one summary line each, write summary.json."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined
    else:
        os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TQDM_DISABLE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    from benchmarks.gpu.common import Context, default_out, environment, source_tree_imports

    source_tree_imports()
    if args.prepare:
        from benchmarks.gpu.prepare import prepare

        for line in prepare():
            print(line)
        return 0
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("CUDA is not available: the GPU suite needs a GPU (or --smoke for the CPU smoke run)")
        return 2
    device = "cpu" if args.smoke else "cuda"
    parts = _parts(args.part)
    ctx = Context(out=Path(args.out) if args.out else default_out(device), smoke=args.smoke, device=device)
    ctx.env = environment(device)
    print(
        f"GPU suite on {ctx.env['device_name']}: torch {ctx.env['torch']}, triton {ctx.env['triton']}, "
        f"transformers {ctx.env['transformers']}, CUDA {ctx.env.get('cuda')}; parts {', '.join(parts)}; "
        f"results -> {ctx.out}",
        flush=True,
    )
    t0 = time.perf_counter()
    results = [run_part(ctx, name, args) for name in parts]
    print("== SUMMARY")
    for res in results:
        print(res.summary())
    summary = {
        "environment": ctx.env,
        "seconds": round(time.perf_counter() - t0, 1),
        "smoke": ctx.smoke,
        "parts": {r.part: {"status": r.status, "summary": r.summary(), "targets": r.targets} for r in results},
    }
    ctx.out.mkdir(parents=True, exist_ok=True)
    if not ctx.smoke:  # parts spread over several device calls: keep each call's summary
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
        (ctx.out / f"summary_{stamp}.json").write_text(json.dumps(summary, indent=1, default=str))
    (ctx.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"total {summary['seconds']:.0f} s; results in {ctx.out}")
    return 1 if any(r.status in ("fail", "crashed") for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
