"""The report of an evaluation: summaries in JSON, plot data in JSON, per-edit rows in gzip JSONL.

``eval_report.json`` holds the summaries (what a results folder keeps); the
per-edit rows go to ``eval_rows.jsonl.gz`` beside it, one
``{"editor": name, "row": row}`` object per line (editors in report order,
rows in stream order), and the data of the figures to ``eval_plots.json``,
``{"editors": {name: plots}}``. Both are dumps the command regenerates: a
report whose dumps were not kept loads with no rows and no plot data.
Reports written before the rows or the plot data were split out (inline in
the JSON) load as well.
"""

from __future__ import annotations

import dataclasses
import gzip
import io
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from .definitions import METRIC_DEFINITIONS, SCHEMA

REPORT_NAME = "eval_report.json"
ROWS_NAME = "eval_rows.jsonl.gz"
PLOTS_NAME = "eval_plots.json"


@dataclasses.dataclass
class EditorResult:
    """One editor's per-edit rows and summary (JSON-ready) plus plot data."""

    name: str
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    info: dict[str, Any]
    plots: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "info": self.info, "summary": self.summary, "plots": self.plots, "rows": self.rows}


@dataclasses.dataclass
class EvalReport:
    """The report of :func:`aloe_eval.evaluate`.

    ``editors`` maps each editor's name to its :class:`EditorResult`;
    ``primary`` names the editor passed as ``op`` (``.summary`` and ``.rows``
    are its). Everything is JSON-serialisable through :meth:`to_dict`.
    """

    meta: dict[str, Any]
    editors: dict[str, EditorResult]
    primary: str

    @property
    def summary(self) -> dict[str, Any]:
        return self.editors[self.primary].summary

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.editors[self.primary].rows

    def to_dict(self) -> dict[str, Any]:
        """The whole report, rows included, as one JSON-ready dictionary."""
        return {
            "schema": SCHEMA,
            "meta": self.meta,
            "primary": self.primary,
            "definitions": METRIC_DEFINITIONS,
            "editors": {k: v.to_dict() for k, v in self.editors.items()},
        }

    def to_json(self, indent: int | None = 1) -> str:
        """The report without its per-edit rows and plot data (they go to :data:`ROWS_NAME`
        and :data:`PLOTS_NAME`)."""
        d = self.to_dict()
        for e in d["editors"].values():
            del e["rows"], e["plots"]
        d["rows_file"] = ROWS_NAME
        d["plots_file"] = PLOTS_NAME
        return json.dumps(jsonable(d), indent=indent, ensure_ascii=False, allow_nan=False)

    def plots_json(self) -> str:
        """The plot data of every editor, as :data:`PLOTS_NAME` holds it."""
        d = {"editors": {k: v.plots for k, v in self.editors.items()}}
        return json.dumps(jsonable(d), ensure_ascii=False, allow_nan=False, separators=(",", ":"))

    def to_markdown(self) -> str:
        from .markdown import render_markdown

        return render_markdown(self.to_dict())

    def save(self, out_dir: str | os.PathLike, plots: bool = True) -> dict[str, Path]:
        """Write the JSON report, its rows, its plot data, ``eval_report.md`` and (if ``plots``) PNG
        figures; returns the paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {
            "json": out / REPORT_NAME,
            "rows": out / ROWS_NAME,
            "plots": out / PLOTS_NAME,
            "markdown": out / "eval_report.md",
        }
        paths["json"].write_text(self.to_json() + "\n")
        paths["rows"].write_bytes(rows_gzip(self.editors))
        paths["plots"].write_text(self.plots_json() + "\n")
        paths["markdown"].write_text(self.to_markdown())
        if plots:
            from .plots import plot_report

            for key, p in plot_report(self.to_dict(), out).items():
                paths[f"plot:{key}"] = p
        return paths

    @classmethod
    def load(cls, path: str | os.PathLike) -> "EvalReport":
        """Read a report from its JSON file (or the directory holding it), its rows and its plot data
        (none of either when their file is absent)."""
        path = Path(path)
        if path.is_dir():
            path = path / REPORT_NAME
        d = json.loads(path.read_text())
        rows: dict[str, list[dict[str, Any]]] = {k: list(v.get("rows", [])) for k, v in d["editors"].items()}
        rows_file = path.parent / d["rows_file"] if d.get("rows_file") else None
        if rows_file is not None and rows_file.is_file():
            with gzip.open(rows_file, "rt", encoding="utf-8") as f:
                for line in f:
                    item = json.loads(line)
                    rows[item["editor"]].append(item["row"])
        plots = read_plots(path.parent, d)
        eds = {k: EditorResult(v["name"], v["summary"], rows[k], v["info"], plots.get(k, {})) for k, v in d["editors"].items()}
        return cls(d["meta"], eds, d["primary"])


def read_plots(out_dir: str | os.PathLike, report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each editor's plot data for the report JSON ``report`` saved in ``out_dir``: inline in older
    reports, else from its :data:`PLOTS_NAME`; editors without any are left out."""
    inline = {k: v["plots"] for k, v in report["editors"].items() if v.get("plots")}
    if inline or not report.get("plots_file"):
        return inline
    file = Path(out_dir) / report["plots_file"]
    return json.loads(file.read_text())["editors"] if file.is_file() else {}


def plot_saved(out_dir: str | os.PathLike) -> dict[str, Path]:
    """Re-draw the figures of the report saved in ``out_dir`` (its rows are not read); ``{}`` when its
    plot data was not kept."""
    from .plots import plot_report

    report = json.loads((Path(out_dir) / REPORT_NAME).read_text())
    plots = read_plots(out_dir, report)
    for name, ed in report["editors"].items():
        ed["plots"] = plots.get(name, {})
    return plot_report(report, out_dir)


def rows_gzip(editors: dict[str, EditorResult]) -> bytes:
    """The per-edit rows as gzip JSONL, byte for byte the same for the same rows (no timestamp)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=buf, mtime=0) as gz:
        for name, e in editors.items():
            for row in e.rows:
                line = json.dumps(
                    {"editor": name, "row": jsonable(row)}, ensure_ascii=False, allow_nan=False, separators=(",", ":")
                )
                gz.write(line.encode("utf-8") + b"\n")
    return buf.getvalue()


def jsonable(x: Any) -> Any:
    """``x`` with non-finite floats as None, tuples as lists and tensors as lists."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return jsonable(x.tolist())
    return x
