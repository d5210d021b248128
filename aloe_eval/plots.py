"""Figures of an evaluation report, after the paper's Figure 3 (runtime behaviour of the gates).

For every editor with slots (ALOE gates, GRACE codebook hits):

* ``<editor>_gates.png``: (a) histograms of the matched-slot gate on requests
  and on rephrases and of the maximum gate on locality prompts; (b) the
  slot-response heatmap: gates of the first 32 requests (rows) at the slots of
  the first 32 edits (columns), so a working address lights the diagonal;
  (c) when available, the paired final-layer locality states (unedited vs
  edited) under a shared PCA, with the mean relative drift and the next-token
  agreement in the title.

Everything is drawn from the JSON report (``EvalReport.to_dict()``); a saved
report is re-plotted from its ``eval_report.json`` and ``eval_plots.json`` by
:func:`aloe_eval.report.plot_saved`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping

__all__ = ["plot_editor", "plot_report"]


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "editor"


def plot_editor(editor: Mapping[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Draw one editor's gate figure (needs ``editor["plots"]["gates"]``); returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    plots = editor.get("plots") or {}
    gates = plots.get("gates") or {}
    heat = plots.get("heatmap")
    pca = plots.get("pca")
    ncols = 2 + (1 if pca else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 4.2))
    ax = axes[0]
    bins = np.linspace(0, 1, 41)
    series = [
        ("requests (matched slot)", gates.get("request") or [], "tab:blue"),
        ("rephrases (matched slot)", gates.get("rephrase") or [], "tab:orange"),
        ("locality (max over slots)", gates.get("locality_max") or [], "tab:green"),
    ]
    present = [(label, vals, color) for label, vals, color in series if vals]
    if present:
        ax.hist(
            [np.clip(v, 0, 1) for _, v, _ in present],
            bins=bins,
            histtype="bar",
            color=[c for _, _, c in present],
            weights=[np.full(len(v), 1 / len(v)) for _, v, _ in present],
            label=[f"{lab}: n={len(v)}, mean={float(np.mean(v)):.3f}" for lab, v, _ in present],
        )
        ax.set_yscale("log")
        smallest = min(1 / len(v) for _, v, _ in present)
        ax.set_ylim(smallest / 2, 1.5)
    ax.set_xlabel("gate")
    ax.set_ylabel("share of queries (log)")
    ax.set_title("(a) gate distributions")
    ax.legend(fontsize=7, loc="upper center")

    ax = axes[1]
    if heat and heat.get("matrix"):
        m = np.asarray(heat["matrix"], dtype=float)
        im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis", aspect="auto", interpolation="nearest")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        ax.set_xlabel("slot of edit j")
        ax.set_ylabel("request i")
        ax.set_title(f"(b) slot responses, first {m.shape[0]} requests")
    else:
        ax.axis("off")

    if pca:
        ax = axes[2]
        ref = np.asarray(pca["reference"], dtype=float)
        ed = np.asarray(pca["edited"], dtype=float)
        moved = np.linalg.norm(ref - ed, axis=1) > 1e-9
        ax.scatter(ref[:, 0], ref[:, 1], s=6, alpha=0.5, color="tab:gray", label="unedited")
        ax.scatter(ed[:, 0], ed[:, 1], s=6, alpha=0.5, color="tab:red", label="edited")
        for a, b in zip(ref[moved][:200], ed[moved][:200]):
            ax.plot([a[0], b[0]], [a[1], b[1]], lw=0.4, color="tab:red", alpha=0.4)
        ev = pca.get("explained") or [0, 0]
        ax.set_xlabel(f"PC1 ({100 * ev[0]:.1f}%)")
        ax.set_ylabel(f"PC2 ({100 * ev[1]:.1f}%)" if len(ev) > 1 else "PC2")
        ls = (editor.get("summary") or {}).get("locality_states") or {}
        drift = (ls.get("drift") or {}).get("mean")
        agree = ls.get("next_token_agreement")
        sub = []
        if drift is not None:
            sub.append(f"mean drift {100 * drift:.2f}%")
        if agree is not None:
            sub.append(f"next-token agreement {100 * agree:.1f}%")
        ax.set_title("(c) locality final states\n" + ", ".join(sub), fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(title or str(editor.get("name", "")))
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def plot_report(report: Mapping[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write one gate figure per slot-based editor into ``out_dir``; returns ``{editor name: path}``."""
    out = {}
    meta = report.get("meta", {})
    for name, ed in report["editors"].items():
        if not (ed.get("plots") or {}).get("gates"):
            continue
        title = f"{name}: {meta.get('model', '')} layer {meta.get('layer', '')}, {meta.get('n_edits', '')} edits"
        out[name] = plot_editor(ed, Path(out_dir) / f"{_slug(name)}_gates.png", title=title)
    return out
