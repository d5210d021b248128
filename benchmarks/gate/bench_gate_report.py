"""Output of the gate microbenchmark (:mod:`benchmarks.gate.bench_gate`): the summary of its CPU
targets, and its results as ``<out>.csv``, ``<out>.json`` and ``<out>.png``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path


def _find(rows, **kw):
    """The rows matching every ``key=value`` of ``kw``, by provider."""
    return {r["provider"]: r for r in rows if all(r.get(k) == v for k, v in kw.items())}


def summarize(rows: list[dict]) -> dict:
    """The CPU targets: sparse vs reference at SmolLM2, n=10000, T=16 (one active edit, all open)."""
    out = {"lines": []}
    for active, key in (("1", "one_active"), ("all", "all_open")):
        r = _find(rows, shape="smollm2", n=10000, T=16, active=active)
        if "sparse" in r and "reference" in r:
            ratio = r["reference"]["median_ms"] / r["sparse"]["median_ms"]
            ratio_min = r["reference"]["min_ms"] / r["sparse"]["min_ms"]
            out[key] = {
                "reference_ms": r["reference"]["median_ms"],
                "sparse_ms": r["sparse"]["median_ms"],
                "speedup_median": round(ratio, 3),
                "speedup_min": round(ratio_min, 3),
            }
            target = ">= 1.3x" if active == "1" else ">= 0.909x (never >10% slower)"
            out["lines"].append(
                f"target smollm2 n=10000 T=16 active={active}: sparse {r['sparse']['median_ms']:.2f} ms"
                f" vs reference {r['reference']['median_ms']:.2f} ms -> {ratio:.2f}x"
                f" (min-time ratio {ratio_min:.2f}x; target {target})"
            )
    return out


def write_results(prefix: Path, rows, env, skipped, skipped_workloads, summary, plot=True) -> None:
    """The rows as ``<prefix>.csv``, everything as ``<prefix>.json``, and (``plot``) ``<prefix>.png``."""
    csv_path = prefix.with_suffix(".csv")
    keys: list[str] = []
    for r in rows:
        for k in r:
            if k not in keys:
                keys.append(k)
    with open(csv_path, "w", newline="") as f:
        wr = csv.DictWriter(f, fieldnames=keys)
        wr.writeheader()
        for r in rows:
            wr.writerow(r)
    payload = {
        "environment": env,
        "skipped_providers": skipped,
        "skipped_workloads": skipped_workloads,
        "summary": {k: v for k, v in summary.items() if k != "lines"},
        "rows": rows,
    }
    prefix.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    print(f"wrote {csv_path} and {prefix.with_suffix('.json')}")
    if plot and rows:
        try:
            png = plot_results(prefix.with_suffix(".png"), rows, env)
            print(f"wrote {png}")
        except Exception as exc:  # plotting must never lose the numbers
            print(f"plot skipped: {type(exc).__name__}: {exc}")


def plot_results(path: Path, rows: list[dict], env: dict) -> Path:
    """Median time against T per provider, one log-log panel per (shape, n, active)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["shape"], r["n"], r["active"]) for r in rows}, key=lambda k: (k[0], k[1], str(k[2])))
    cols = min(4, len(panels))
    nrows = -(-len(panels) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    for ax, (shape, n, active) in zip(axes.flat, panels):
        sel = [r for r in rows if (r["shape"], r["n"], r["active"]) == (shape, n, active)]
        for prov in sorted({r["provider"] for r in sel}):
            pts = sorted((r["T"], r["median_ms"]) for r in sel if r["provider"] == prov)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=prov)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{shape} n={n} active={active}", fontsize=9)
        ax.set_xlabel("tokens T")
        ax.set_ylabel("median ms")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    dev = env.get("gpu") or env.get("cpu")
    fig.suptitle(f"ALOE gate residual, {env['dtype']} on {dev} (torch {env['torch']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
