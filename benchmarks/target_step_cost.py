"""What one stage-6 step costs against the number of edits in its batch.

Resumes a finished build from its stage 2-5 checkpoints (as ``write_stage_cost`` does) up to the
point where stage 6 would start, then, instead of fitting, times one optimiser step's forward and
backward (``EditedForward.scored`` and the gradient of the deltas) on the first R slots of a few of
stage 6's batches, for each R asked. A step streams every weight of the upper layers and the
vocabulary matrix whatever R is, so its cost is a fixed part plus a part per edit; the ratio of the
two decides how many edits a batch should hold (``target_batch``).

    python -m benchmarks.target_step_cost runs/cf1301 --edits cf.json --limit 1301 --rows 64,32,16,8,4,1
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

import aloe_build.pipeline as pipeline
from aloe_build import build_operator, load_edits, load_model
from aloe_build.writes import target_batches
from benchmarks.write_stage_cost import build_arguments, built_config, resumed_copy


class _Measured(Exception):
    """Raised in place of stage 6 once the steps are timed."""


def step_seconds(fwd, rows_of: list[list[int]], slots: list[int], repeats: int) -> float:
    """Median seconds of one forward and backward of stage 6 on ``slots``."""
    rows = [r for s in slots for r in rows_of[s]]
    delta = torch.zeros(len(rows), fwd.d_out, requires_grad=True)
    gates = fwd.own_gates(rows)[..., None]
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        nll, _ = fwd.scored(rows, gates * delta[:, None, :])
        nll.sum().backward()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> None:
    ap = build_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--rows", default="64,32,16,8,4,1", help="comma-separated batch sizes R (slots per step)")
    ap.add_argument("--batches", default="0.1,0.5,0.9",
                    help="where in stage 6's order to take the slots, as fractions of its batches of max(R)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    build = Path(args.build_dir)
    cfg = built_config(build)
    sizes = [int(r) for r in args.rows.split(",")]
    requests = load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid)
    model, tok = load_model(args.model)

    def measure(fwd, cfg, parts=None, rows_of=None, stats=None):
        rows_of = [[i] for i in range(fwd.n_slots)] if rows_of is None else [list(r) for r in rows_of]
        batches = target_batches(fwd, rows_of, max(sizes))
        with fwd.frozen():
            for where in (float(f) for f in args.batches.split(",")):
                k = min(len(batches) - 1, int(where * len(batches)))
                for R in sizes:
                    slots = batches[k][:R]
                    seconds = step_seconds(fwd, rows_of, slots, args.repeats)
                    upper = max(fwd.upper_positions(r) for s in slots for r in rows_of[s])
                    print(f"batch {k} of {len(batches)}, R {len(slots):3d} (upper positions {upper}): step "
                          f"{seconds * 1e3:.0f} ms, {seconds * 1e3 / len(slots):.1f} ms per edit", flush=True)
        raise _Measured

    real = pipeline.write_targets
    pipeline.write_targets = measure
    try:
        with tempfile.TemporaryDirectory() as tmp:
            build_operator(model, tok, requests, cfg, out_dir=resumed_copy(build, Path(tmp) / "run"), log=None)
    except _Measured:
        pass
    finally:
        pipeline.write_targets = real
    print(f"threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
