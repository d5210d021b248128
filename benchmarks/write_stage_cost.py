"""Stages 6-8 of a finished build run again two ways in one process: without and with the cached
prefix of the upper layers, or (``--set KEY=VALUE``) with the build's settings and with those.

Copies the build's checkpoints of stages 2-5 into two scratch directories and resumes the build in
each (same edits, same configuration, read from ``build_report.json``). Without ``--set``, once with
the write stages' upper-layer pass over every position and once over the positions after each
sequence's first open gate (the default). Prints each stage's seconds, their ratio, and how far the
two sets of writes and their produced requests differ.

    python -m benchmarks.write_stage_cost runs/zsre-chat100 --edits zsre-tune100.json --skip-invalid
    python -m benchmarks.write_stage_cost runs/cf1301 --edits cf.json --limit 1301 --set target_stop_nll=0
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import tempfile
from pathlib import Path

import torch

import aloe_build.edited_forward as edited_forward
from aloe_build import BuildConfig, build_operator, load_edits, load_model
from aloe_build.config import parse_settings

_KEPT = ("2_init", "3_rollouts", "4_refine", "5_calibrate")


def resumed_copy(build: Path, scratch: Path) -> Path:
    (scratch / "checkpoints").mkdir(parents=True)
    for f in (build / "checkpoints").iterdir():
        if f.name.split(".")[0] in _KEPT and f.is_file():
            shutil.copy2(f, scratch / "checkpoints" / f.name)
    return scratch


def built_config(build: Path) -> BuildConfig:
    """The configuration a finished build ran with (its ``build_report.json``)."""
    return BuildConfig.from_dict(json.loads((build / "build_report.json").read_text())["config"])


def build_arguments(ap: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments that name a finished build and the edits it was made from."""
    ap.add_argument("build_dir")
    ap.add_argument("--edits", required=True, help="the edit file the build was made from")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--skip-invalid", action="store_true")
    ap.add_argument("--model", default="smollm2")
    return ap


def main(argv: list[str] | None = None) -> None:
    ap = build_arguments(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="the second run's settings of stages 6-8 (parsed as aloe build --set); both runs cache")
    args = ap.parse_args(argv)
    build = Path(args.build_dir)
    cfg = built_config(build)
    other = BuildConfig.from_dict({**cfg.to_dict(), **parse_settings(args.set)}) if args.set else None
    requests = load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid)
    model, tok = load_model(args.model)
    real_init = edited_forward.EditedForward.__init__
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for second in (False, True):
            cache_prefix = second or other is not None
            edited_forward.EditedForward.__init__ = functools.partialmethod(real_init, cache_prefix=cache_prefix)
            try:
                out = resumed_copy(build, Path(tmp) / f"run-{second}")
                op = build_operator(model, tok, requests, other if second and other else cfg, out_dir=out, log=None)
            finally:
                edited_forward.EditedForward.__init__ = real_init
            stages = json.loads((out / "build_report.json").read_text())["stages"]
            runs[second] = (op.writes.float(), stages)
            name = (" ".join(args.set) if second else "as built") if other else \
                f"cached prefix {'on ' if cache_prefix else 'off'}"
            print(f"{name}: " + ", ".join(
                f"{k} {stages[k]['seconds']:.1f} s" for k in ("6_targets", "7_ridge", "8_finetune")) +
                f"; requests produced after stage 8: {stages['8_finetune'].get('produced'):.3f}")
    (u_off, s_off), (u_on, s_on) = runs[False], runs[True]
    for k in ("6_targets", "8_finetune"):
        print(f"{k}: second / first time {s_on[k]['seconds'] / s_off[k]['seconds']:.2f}")
    print(f"writes: max |U_second - U_first| {float((u_on - u_off).abs().max()):.2e}, "
          f"relative {float((u_on - u_off).norm() / u_off.norm().clamp_min(1e-12)):.2e}; threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
