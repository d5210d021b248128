"""The GPU suite's CPU smoke mode (``python -m benchmarks.gpu_suite --smoke``): every part
reports and writes its files, the kernel checks agree with float64, and no GPU target
gets a verdict from a CPU run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("tests", "graph", "gate", "decode", "build", "smollm2", "acceptance")


@pytest.mark.slow
def test_gpu_suite_smoke(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)  # the suite must set it itself, before any kernel import
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_suite", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )  # ~40 s on an idle 2-core CPU; room for a loaded one
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["parts"]) == set(PARTS)
    tail = proc.stdout.split("== SUMMARY", 1)[1]
    for part in PARTS:
        assert (tmp_path / f"{part}.json").is_file() and (tmp_path / f"{part}.txt").is_file()
        assert f"\n{part}: " in tail, f"no summary line for {part}"
        assert summary["parts"][part]["status"] in ("ok", "skipped"), summary["parts"][part]

    graph = json.loads((tmp_path / "graph.json").read_text())
    assert graph["environment"]["torch"] and graph["environment"]["timestamp_utc"]
    checks = [c for c in graph["data"]["checks"] if "rel_err" in c]
    assert len(checks) >= 4 and all(c["ok"] and c["rel_err"] <= 1e-4 for c in checks)  # fp32 vs float64

    gate = json.loads((tmp_path / "gate.json").read_text())
    errs = [r["rel_err_vs_float64"] for r in gate["data"]["rows"]]
    assert errs and max(errs) <= 1e-4
    # The fused kernel is not timed on CPU: every target reads n/a, none is made up.
    for part in ("gate", "decode"):
        targets = json.loads((tmp_path / f"{part}.json").read_text())["targets"]
        assert targets and all(t["verdict"] == "n/a" and t["value"] is None for t in targets)
