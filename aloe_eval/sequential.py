"""The lifelong (sequential) protocol of WISE and GRACE: edits arrive in K batches.

The first batch is built (:func:`aloe_build.build_operator`), each later one
appended to the operator so far (:func:`aloe_build.append.append_edits`), and
after every batch all the edits so far are scored with the paper's protocol.
Each step's operator goes to ``<out>/op<k>`` and its scores to
``<out>/step<k>.json``, so an interrupted run resumes at the first step
without them. ``sequential.json`` collects the curve and ``retention.png``
plots it: efficacy, generalization and locality of all edits so far, and the
efficacy of the first batch's edits (what later edits cost the earliest ones).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Sequence

from aloe_build import BuildConfig, build_operator
from aloe_build.append import append_edits
from aloe_kernels import AloeOperator

from .protocol import evaluate

__all__ = ["batch_bounds", "run_sequential"]


def batch_bounds(n: int, k: int) -> list[tuple[int, int]]:
    """``k`` contiguous batches of ``n`` edits, ``ceil(n / k)`` each (the last may be shorter)."""
    if not 1 <= k <= n:
        raise ValueError(f"cannot split {n} edits into {k} batches")
    size = math.ceil(n / k)
    return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


def _complete(d: Path) -> bool:
    return all((d / f).is_file() for f in ("aloe_config.json", "aloe_operator.safetensors", "aloe_build_state.json"))


def _operator(
    model, tokenizer, requests: Sequence, bounds, k: int, out: Path, config: BuildConfig | None, log: Callable[[str], None]
) -> AloeOperator:
    """Step ``k``'s operator: built (k = 0) or appended to step k-1's, or read back when already there."""
    d = out / f"op{k}"
    if _complete(d):
        return AloeOperator.load(d)
    lo, hi = bounds[k]
    if k == 0:
        op = build_operator(model, tokenizer, requests[lo:hi], config, out_dir=d, log=log)
    else:
        op = append_edits(model, tokenizer, out / f"op{k - 1}", requests[lo:hi], config, out_dir=d, log=log)
    op.save(d)
    return op


def _step(report, bounds: list[tuple[int, int]], k: int, seconds: float | None) -> dict[str, Any]:
    paper = report.summary["paper"]
    first = [r["efficacy"] for r in report.rows[: bounds[0][1]] if r.get("efficacy") is not None]
    return {
        "step": k,
        "edits": bounds[k][1],
        "efficacy": paper["efficacy"],
        "generalization": paper["generalization"],
        "locality": paper["locality"],
        "first_batch_efficacy": sum(first) / len(first) if first else None,
        "operator_n": report.meta.get("operator_n"),
        "eval_seconds": seconds,
    }


def run_sequential(
    model,
    tokenizer,
    requests: Sequence,
    batches: int,
    out_dir: str | Path,
    config: BuildConfig | None = None,
    batch_size: int = 32,
    progress: bool = True,
    log: Callable[[str], None] | None = print,
) -> dict[str, Any]:
    """Run the protocol on ``requests`` in ``batches`` batches; returns (and writes) ``sequential.json``."""
    say = log or (lambda _m: None)
    requests = list(requests)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    bounds = batch_bounds(len(requests), batches)
    steps = []
    for k in range(len(bounds)):
        step_file = out / f"step{k}.json"
        if step_file.is_file():
            steps.append(json.loads(step_file.read_text()))
            continue
        op = _operator(model, tokenizer, requests, bounds, k, out, config, say)
        report = evaluate(model, tokenizer, requests[: bounds[k][1]], op, batch_size=batch_size, progress=progress)
        step = _step(report, bounds, k, report.meta.get("timings", {}).get("total_s"))
        step_file.write_text(json.dumps(step, indent=1))
        steps.append(step)
        say(
            f"step {k + 1}/{len(bounds)}: {step['edits']} edits; "
            + ", ".join(f"{key} {_fmt(step[key])}" for key in ("efficacy", "generalization", "locality"))
        )
    result = {"batches": len(bounds), "edits": len(requests), "steps": steps}
    (out / "sequential.json").write_text(json.dumps(result, indent=1))
    plot_retention(steps, out / "retention.png")
    return result


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def plot_retention(steps: Sequence[dict[str, Any]], path: Path) -> Path:
    """Efficacy, generalization, locality and first-batch efficacy against the number of edits."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    x = [s["edits"] for s in steps]
    for key, label in (
        ("efficacy", "efficacy (all edits so far)"),
        ("generalization", "generalization"),
        ("locality", "locality"),
        ("first_batch_efficacy", "efficacy of the first batch"),
    ):
        ax.plot(x, [float("nan") if s[key] is None else s[key] for s in steps], marker="o", label=label)
    ax.set_xlabel("edits so far")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="center right", fontsize=8)
    ax.set_title("sequential editing: scores after each batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
