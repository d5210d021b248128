"""Stage 4 on a build's checkpoints: settings of the refinement timed in the same process, with the
calibration each gives (by default, refinement on the slots still violating against every slot in
every step; ``--variant`` compares any stage-4 settings).

    python -m benchmarks.refine_cost runs/cf839 --edits $DATA/counterfact/counterfact-val.json --limit 839
    python -m benchmarks.refine_cost runs/cf839 --edits runs/cf-stream.jsonl --limit 839 \
        --variant refine_candidates=0 --variant refine_candidates=512

The build must use the default settings of stages 2-3 (no soft anchors: positives_same_relation 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from aloe_build import addresses as addr
from aloe_build import calibration
from aloe_build.config import BuildConfig
from aloe_build.data import load_edits
from aloe_build.pipeline import negative_set
from aloe_build.slots import make_slots, same_prompt_matrix
from aloe_kernels.operator import DEFAULT_GATE_EPS


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--edits", required=True, help="the edit file the build was made from")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--every", type=int, nargs="+", default=[0, BuildConfig().refine_active_every],
                    help="refine_active_every values to time (0: every slot, every step)")
    ap.add_argument("--variant", action="append", default=None, metavar="KEY=VALUE[,KEY=VALUE]",
                    help="stage-4 settings to time instead of --every (repeat the flag per variant)")
    args = ap.parse_args(argv)
    ckpt = Path(args.build_dir) / "checkpoints"
    roll = load_file(str(ckpt / "3_rollouts.safetensors"))
    V0 = load_file(str(ckpt / "2_init.safetensors"))["V0"]
    slots = make_slots(load_edits(args.edits, limit=args.limit))
    if len(slots) != V0.shape[0]:
        raise SystemExit(f"{len(slots)} slots from the edits but {V0.shape[0]} in the build")
    same = same_prompt_matrix(slots)
    negatives = negative_set(roll)
    print(f"n={V0.shape[0]} anchors={roll['anchors'].shape[0]} negatives="
          f"{negatives.shared.shape[0] + negatives.specific.shape[0]} threads={torch.get_num_threads()}")
    results = {}
    variants = args.variant or [f"refine_active_every={every}" for every in args.every]
    for name in variants:
        cfg = dataclasses.replace(BuildConfig(), **_settings(name))
        t0 = time.perf_counter()
        V, losses = addr.refine_addresses(V0, roll["anchors"], roll["anchor_owner"], negatives, same, cfg)
        seconds = time.perf_counter() - t0
        cal = calibration.calibrate(V, roll["anchors"], roll["anchor_owner"], negatives, same, DEFAULT_GATE_EPS, cfg)
        gap = cal.worst_positive - cal.worst_negative
        results[name] = V
        print(f"{name}: {seconds:.1f} s for {len(losses)} steps, loss {losses[0]:.1f} -> "
              f"{losses[-1]:.3f}; separable {int(cal.separable.sum())}/{len(gap)}, worst-anchor minus worst-negative "
              f"score: median {float(gap.median()):.3f}, min {float(gap.min()):.3f}")
    if len(results) > 1:
        first_name, first = next(iter(results.items()))
        for name, V in list(results.items())[1:]:
            print(f"max |V({name}) - V({first_name})| = {float((V - first).abs().max()):.3e}")


def _settings(variant: str) -> dict:
    """``KEY=VALUE,KEY=VALUE`` as BuildConfig fields (values read as JSON; unknown fields refused)."""
    pairs = (item.partition("=") for item in filter(None, variant.split(",")))
    out = {key: json.loads(value) for key, _, value in pairs}
    BuildConfig.from_dict(out)
    return out


if __name__ == "__main__":
    main()
