"""Stage 6 of a finished build run again, each edit's target NLL recorded at every step: how many
optimiser steps an edit would take if it left its batch once produced with its NLL at most a bound
(``BuildConfig.target_stop_nll``).

Copies the build's checkpoints of stages 2-5 into a scratch directory, resumes the build there with
``target_stop_nll=0`` (every edit takes ``target_steps``), stops after stage 6 and prints, for each
bound, the mean step at which an edit would leave, that as a share of all the edit-steps, and the mean
NLL the edits leave with.

    python -m benchmarks.target_stop_steps runs/cf1301 --edits $DATA/counterfact/counterfact-val.json --limit 1301
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import aloe_build.pipeline as pipeline
from aloe_build import BuildConfig, build_operator, load_edits, load_model
from aloe_build.edited_forward import EditedForward

_KEPT = ("2_init", "3_rollouts", "4_refine", "5_calibrate")


class _Stage6Done(Exception):
    """Raised after stage 6 to skip the later stages."""


def leave_steps(trajectories: list[list[tuple[float, bool]]], bound: float, steps: int) -> list[int]:
    """For each edit's (NLL, produced) per step, the first step before ``steps`` at which it is produced
    with its NLL at most ``bound`` (else ``steps``, or its last recorded step)."""
    return [next((k for k, (nll, made) in enumerate(t[:steps]) if made and nll <= bound), min(steps, len(t) - 1))
            for t in trajectories]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--edits", required=True, help="the edit file the build was made from")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--bounds", default="0.01,0.02,0.03,0.05,0.1,0.2")
    args = ap.parse_args(argv)
    build = Path(args.build_dir)
    cfg = BuildConfig.from_dict(json.loads((build / "build_report.json").read_text())["config"])
    cfg = dataclasses.replace(cfg, target_stop_nll=0.0)
    trajectories: dict[int, list[tuple[float, bool]]] = {}
    real_scored, real_write_targets = EditedForward.scored, pipeline.write_targets

    def scored(self, rows, residual):
        nll, exact = real_scored(self, rows, residual)
        for r, v, e in zip(rows, nll.detach().float().tolist(), exact.tolist()):
            trajectories.setdefault(r, []).append((v, bool(e)))
        return nll, exact

    def write_targets(*a, **k):
        real_write_targets(*a, **k)
        raise _Stage6Done

    model, tok = load_model(args.model)
    EditedForward.scored, pipeline.write_targets = scored, write_targets
    try:
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "checkpoints").mkdir()
            for f in (build / "checkpoints").iterdir():
                if f.name.split(".")[0] in _KEPT and f.is_file():
                    shutil.copy2(f, Path(tmp) / "checkpoints" / f.name)
            try:
                build_operator(model, tok, load_edits(args.edits, limit=args.limit), cfg, out_dir=tmp, log=None)
            except _Stage6Done:
                pass
    finally:
        EditedForward.scored, pipeline.write_targets = real_scored, real_write_targets
    runs = list(trajectories.values())  # one sequence per edit without chat forms
    steps = cfg.target_steps
    final = [t[min(steps, len(t) - 1)][0] for t in runs]
    print(f"{len(runs)} sequences, {steps} steps each; NLL after them: mean {sum(final) / len(final):.4f}")
    for bound in (float(b) for b in args.bounds.split(",")):
        left = leave_steps(runs, bound, steps)
        nll = [t[k][0] for t, k in zip(runs, left)]
        print(f"target_stop_nll={bound}: mean leaving step {sum(left) / len(left):.1f}, "
              f"{sum(left) / (steps * len(left)):.2f} of the edit-steps, mean NLL left with {sum(nll) / len(nll):.4f}")


if __name__ == "__main__":
    main()
