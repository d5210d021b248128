"""Build cost and quality of one stream's operators against the number of edits.

Each ``--run N:BUILD_DIR[:EVAL_DIR]`` names the build of a stream's first N edits (its
``build_report.json``, or that file itself) and, optionally, the directory of its evaluation (``eval_report.json``).
Writes, under ``--out``: ``scale.md`` (per-stage wall and CPU seconds per edit, peak memory,
paper-protocol quality), ``scale.json`` (the same numbers) and ``scale.png`` (efficacy,
generalization and locality against n). Wall seconds depend on what else the machine ran; the CPU
seconds (every thread of the process) much less, so the per-edit comparison reads those where a
report has them.

    python -m benchmarks.scale_report --run 839:runs/cf839:runs/cf839/eval \\
        --run 4000:runs/cf4000:runs/cf4000/eval --out benchmarks/results/scale_smollm2_cf-stream
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Sequence

METRICS = ("efficacy", "generalization", "locality")
# locality without the locality prompts that are requests of the stream itself (their answers are meant to change)
OUTSIDE = "locality_outside_stream"


def _run(spec: str) -> tuple[int, Path, Path | None]:
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not parts[0].isdigit():
        raise argparse.ArgumentTypeError(f"expected N:BUILD_DIR[:EVAL_DIR], got {spec!r}")
    return int(parts[0]), Path(parts[1]), Path(parts[2]) if len(parts) == 3 else None


def collect(n: int, build_dir: Path, eval_dir: Path | None) -> dict[str, Any]:
    """The per-stage cost of one build and, with ``eval_dir``, the quality of its operator."""
    file = build_dir if build_dir.suffix == ".json" else build_dir / "build_report.json"
    report = json.loads(file.read_text())
    if report.get("edits") != n:
        raise SystemExit(f"{build_dir}: build of {report.get('edits')} edits, not {n}")
    stages = {}
    for name, info in report["stages"].items():
        if not isinstance(info, dict) or "seconds" not in info:
            continue
        stages[name] = {"seconds": info["seconds"], "cpu_seconds": info.get("cpu_seconds"),
                        "peak_rss_gib": info.get("peak_rss_gib"), "resumed": bool(info.get("resumed")),
                        "parts_read_back": info.get("parts_read_back", 0)}
    row: dict[str, Any] = {"n": n, "build": str(build_dir), "stages": stages}
    if eval_dir is not None:
        ev = json.loads((eval_dir / "eval_report.json").read_text())
        paper = ev["editors"][ev["primary"]]["summary"]["paper"]
        row["quality"] = {m: paper.get(m) for m in (*METRICS, OUTSIDE)}
        row["eval_seconds"] = ev["meta"].get("timings", {}).get("total_s")
    return row


def _cell(x: float | None, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(rows: list[dict[str, Any]], notes: Sequence[str] = ()) -> str:
    """Cost and quality tables; ``notes`` (e.g. which machine ran which build) head the cost table."""
    names = list(dict.fromkeys(s for r in rows for s in r["stages"]))
    head = "| stage | " + " | ".join(f"n = {r['n']:,}: s/edit (CPU s/edit)" for r in rows) + " |"
    lines = ["## Build cost per edit", "", *(f"- {note}" for note in notes), *([""] if notes else []),
             head, "|---" * (len(rows) + 1) + "|"]
    for name in names:
        cells = []
        for r in rows:
            st = r["stages"].get(name)
            if st is None:
                cells.append("–")
                continue
            cpu = st["cpu_seconds"]
            cell = f"{st['seconds'] / r['n']:.3f}" + (f" ({cpu / r['n']:.3f})" if cpu is not None else "")
            cells.append(cell + (" resumed" if st["resumed"] else "")
                         + (f" resumed inside ({st['parts_read_back']} parts read back)" if st.get("parts_read_back") else ""))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    total = [sum(st["seconds"] for st in r["stages"].values() if not st["resumed"]) for r in rows]
    lines.append("| total (stages run) | " + " | ".join(f"{t / r['n']:.3f} ({t / 60:.1f} min)" for t, r in zip(total, rows))
                 + " |")
    peak = [max((st["peak_rss_gib"] or 0) for st in r["stages"].values()) or None for r in rows]
    lines.append("| peak RSS (GiB) | " + " | ".join(_cell(p, 2) for p in peak) + " |")
    if any("quality" in r for r in rows):
        lines += ["", "## Quality (paper protocol, one operator per n, scored after all its edits)", "",
                  "| n | " + " | ".join(METRICS) + " | locality outside the stream's requests | eval time |",
                  "|---" * (len(METRICS) + 3) + "|"]
        for r in rows:
            if "quality" in r:
                q = r["quality"]
                secs = r.get("eval_seconds")
                lines.append(f"| {r['n']:,} | " + " | ".join(_cell(q.get(m)) for m in (*METRICS, OUTSIDE))
                             + f" | {_cell(secs / 60 if secs else None, 1)} min |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    rated = [r for r in rows if "quality" in r]
    if not rated:
        return None
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ns = [r["n"] for r in rated]
    for m in METRICS:
        ax.plot(ns, [r["quality"][m] for r in rated], marker="o", label=m)
    outside = [(r["n"], r["quality"][OUTSIDE]) for r in rated if r["quality"].get(OUTSIDE) is not None]
    if outside:  # reports older than the field lack it
        ax.plot(*zip(*outside), marker="o", linestyle="--", label="locality outside\nthe stream's requests")
    ax.set_xscale("log")
    ax.set_xticks(ns, [f"{n:,}" for n in ns])
    ax.minorticks_off()
    ax.set_xlabel("edits in the operator (n)")
    ax.set_ylim(0, 1.02)
    ax.set_title("One operator per n, paper protocol")
    ax.legend(loc="center right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run", type=_run, action="append", required=True, help="N:BUILD_DIR[:EVAL_DIR]")
    ap.add_argument("--out", required=True)
    ap.add_argument("--note", action="append", default=[], help="a line above the cost table (repeatable)")
    args = ap.parse_args(argv)
    rows = sorted((collect(*r) for r in args.run), key=lambda r: r["n"])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(rows, indent=1) + "\n")
    text = markdown(rows, args.note)
    (out / "scale.md").write_text(text)
    plot(rows, out / "scale.png")
    print(text)
    return rows


if __name__ == "__main__":
    main()
