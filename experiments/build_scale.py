"""Per stage, what builds of different sizes and process counts cost: a table from their reports.

For each build folder (its ``build_report.json``): edits, processes, and per stage the wall seconds,
the CPU seconds of every process together, and the peak resident memory of the largest process; then
per edit, and, for builds of the same edits, each one's wall-time speed-up over the first of them.

    python -m experiments.build_scale BUILD_DIR [BUILD_DIR ...] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

STAGES = ("2_init", "3_rollouts", "4_refine", "5_calibrate", "6_targets", "7_ridge", "8_finetune")


def stage_costs(report: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Per stage of one report: ``wall``, ``cpu`` (all processes) and ``peak_gib`` (the largest)."""
    out = {}
    for name in STAGES:
        st = report["stages"].get(name)
        if st is None or st.get("resumed"):
            continue
        out[name] = {
            "wall": float(st["seconds"]),
            "cpu": float(st.get("cpu_seconds_all_ranks", st["cpu_seconds"])),
            "peak_gib": float(max(st.get("peak_rss_gib_per_rank", [st["peak_rss_gib"]]))),
        }
    out["total"] = {
        "wall": sum(v["wall"] for v in out.values()),
        "cpu": sum(v["cpu"] for v in out.values()),
        "peak_gib": max((v["peak_gib"] for v in out.values()), default=0.0),
    }
    return out


def processes(report: dict[str, Any]) -> int:
    """How many processes built it (1 where the report has no per-process figures)."""
    return max((len(st.get("peak_rss_gib_per_rank", [0])) for st in report["stages"].values()), default=1)


def table(reports: dict[str, dict[str, Any]]) -> str:
    """The markdown table of :func:`stage_costs` for each named report, per edit as well, with the
    wall-time speed-up over the first report of the same number of edits."""
    first_of: dict[int, dict[str, dict[str, float]]] = {}
    rows = [
        "| build | edits | processes | stage | wall s | CPU s | peak GiB | wall ms / edit | CPU ms / edit | speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, report in reports.items():
        n, costs = int(report["edits"]), stage_costs(report)
        base = first_of.setdefault(n, costs)
        for name, c in costs.items():
            up = base.get(name, {}).get("wall", 0.0) / c["wall"] if c["wall"] > 0 and name in base else float("nan")
            rows.append(
                f"| {label} | {n} | {processes(report)} | {name} | {c['wall']:.1f} | {c['cpu']:.1f} | {c['peak_gib']:.2f} | "
                f"{1000 * c['wall'] / n:.0f} | {1000 * c['cpu'] / n:.0f} | {up:.2f}x |"
            )
    return "\n".join(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="+", help="build folders holding build_report.json")
    ap.add_argument("--out", help="also write the table here")
    args = ap.parse_args()
    reports = {b.rstrip("/"): json.loads((Path(b) / "build_report.json").read_text()) for b in args.builds}
    text = table(reports)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
