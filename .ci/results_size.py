"""Keep the tracked files under the repository's 5 MB budget.

Run with ``--compact`` after adding results: it rewrites every tracked JSON file under
``benchmarks/results`` without indentation and with floats at six significant digits, and replaces the
metric definitions that every ``eval_report.md`` repeats with a pointer to their source. Without flags it
only prints the total and fails above the budget, so that ``make check`` catches a folder too large.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

BUDGET_BYTES = 5_000_000
RESULTS = "benchmarks/results"
SIGNIFICANT_DIGITS = 6
DEFINITIONS = "## Definitions\n"
DEFINITIONS_POINTER = (
    "The metrics as `aloe_eval/definitions.py` defined them when this report was written "
    "(`aloe eval` writes them here in full).\n"
)


def tracked(root: Path) -> list[Path]:
    """Every file git tracks that is present in the work tree."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, check=True, capture_output=True).stdout
    return [root / name for name in out.decode().split("\0") if name and (root / name).is_file()]


def compacted(value: Any) -> Any:
    """``value`` with its floats rounded."""
    if isinstance(value, float):
        return float(f"{value:.{SIGNIFICANT_DIGITS}g}")
    if isinstance(value, list):
        return [compacted(v) for v in value]
    if isinstance(value, dict):
        return {k: compacted(v) for k, v in value.items()}
    return value


def without_definitions(report: str) -> str:
    """An ``eval_report.md`` with its definitions section (up to the next section) as one line."""
    start = report.find(DEFINITIONS)
    if start < 0:
        return report
    body = start + len(DEFINITIONS)
    end = report.find("\n## ", body)
    end = len(report) if end < 0 else end + 1
    return report[:body] + "\n" + DEFINITIONS_POINTER + "\n" + report[end:]


def compact(root: Path) -> int:
    """Rewrite the tracked results JSON files and evaluation reports; returns the bytes saved."""
    saved = 0
    for path in tracked(root):
        if not path.relative_to(root).as_posix().startswith(RESULTS):
            continue
        before = path.stat().st_size
        if path.suffix == ".json":
            data = compacted(json.loads(path.read_text()))
            path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")) + "\n")
        elif path.name == "eval_report.md":
            path.write_text(without_definitions(path.read_text()))
        saved += before - path.stat().st_size
    return saved


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compact", action="store_true", help="rewrite the tracked results JSON compactly first")
    args = parser.parse_args()
    root = Path(__file__).resolve().parent.parent
    if args.compact:
        print(f"compacted results: {compact(root):,} bytes saved")
    total = sum(p.stat().st_size for p in tracked(root))
    print(f"tracked files: {total:,} bytes of {BUDGET_BYTES:,}")
    if total > BUDGET_BYTES:
        print("over budget: compact the results (--compact) or keep summaries only", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
