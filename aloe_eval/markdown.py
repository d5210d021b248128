"""An evaluation report as Markdown tables."""

from __future__ import annotations

import json
from typing import Any, Mapping

from .definitions import METRIC_DEFINITIONS


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown tables (paper protocol, EasyEdit numbers, diagnostics)."""
    meta = report["meta"]
    eds = report["editors"]
    lines = _header_lines(meta)
    lines += _paper_lines(eds)
    lines += _easyedit_lines(eds)
    lines += _locality_state_lines(eds)
    lines += _diagnostic_lines(eds)
    lines += ["", "## Definitions", ""]
    lines += [f"- `{k}`: {v}" for k, v in report.get("definitions", METRIC_DEFINITIONS).items()]
    lines += _editor_info_lines(eds)
    return "\n".join(lines)


def _header_lines(meta: Mapping[str, Any]) -> list[str]:
    """The title and what the run was: model, data, operator, command, time."""
    lines = [f"# Editing evaluation: {meta.get('model')}", ""]
    layer = meta.get("layer")
    whose = "the operator's, or the model's default; each baseline's own under Editors"
    facts = [
        ("model", meta.get("model")),
        # the operator's layer (or the model's default): GRACE edits it; the others name their own
        ("layer", f"{layer} ({whose})" if layer is not None else None),
        ("edits", meta.get("n_edits")),
        ("data", meta.get("data_file")),
        ("data sha256", meta.get("data_sha256")),
        ("operator", meta.get("operator_dir")),
        ("operator hash", meta.get("operator_hash")),
        ("command", f"`{meta['command']}`" if meta.get("command") else None),
        ("created", meta.get("created")),
        ("total time", f"{meta['timings']['total_s']:.1f} s" if meta.get("timings", {}).get("total_s") else None),
    ]
    # facts the run did not record are left out rather than shown empty
    return lines + [f"- **{k}**: {v}" for k, v in facts if v is not None]


def _paper_lines(eds: Mapping[str, Any]) -> list[str]:
    """The paper-protocol table, the note on locality prompts edited in the stream, and the
    locality and portability numbers by kind."""
    lines = [
        "",
        "## Paper protocol (greedy-generation exact match)",
        "",
        "| Editor | Eff. | Gen. | In context | Loc. | Port. |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in eds.items():
        p = e["summary"]["paper"]
        cells = [p["efficacy"], p["generalization"], p.get("in_context"), p["locality"], p["portability"]]
        lines.append(f"| {name} | " + " | ".join(_f(v) for v in cells) + " |")
    for name, e in eds.items():
        if e["info"].get("kind") == "told":  # its Loc. is another comparison than the other rows'
            lines.append(
                f"\n{name}: the unedited model asked every prompt after the edit's statement; its Loc. compares "
                'the answer to "<statement> <locality prompt>" with the unedited answer to the plain prompt.'
            )
    for name, e in eds.items():
        left_out = e["summary"]["counts"].get("locality_prompts_edited_in_stream")
        if left_out:
            lines.append(
                f"\n{name}: {left_out} locality prompts are requests of edits in this stream (their "
                f"answers are meant to change); locality without them "
                f"{_f(e['summary']['paper'].get('locality_outside_stream'))}."
            )
    if any(e["summary"]["paper"].get("distracted_locality") is not None for e in eds.values()):
        lines += [
            "",
            'After the edit\'s statement ("<request> <target>. <locality prompt>"), against the unedited model:',
            "",
            "| Editor | Distracted loc. | Leak to target |",
            "|---|---|---|",
        ]
        for name, e in eds.items():
            p = e["summary"]["paper"]
            lines.append(f"| {name} | {_f(p.get('distracted_locality'))} | {_f(p.get('distracted_leak'))} |")
    kinds = sorted({k for e in eds.values() for k in e["summary"]["paper"]["portability_by_kind"]})
    lkinds = sorted({k for e in eds.values() for k in e["summary"]["paper"]["locality_by_kind"]})
    # a single locality kind and no portability would only repeat the table above
    if len(lkinds) > 1 or kinds:
        cols = [f"Loc. {k}" for k in lkinds] + [f"Port. {k}" for k in kinds]
        lines += ["", "| Editor | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for name, e in eds.items():
            p = e["summary"]["paper"]
            vals = [p["locality_by_kind"].get(k) for k in lkinds] + [p["portability_by_kind"].get(k) for k in kinds]
            lines.append(f"| {name} | " + " | ".join(_f(v) for v in vals) + " |")
    return lines


def _easyedit_lines(eds: Mapping[str, Any]) -> list[str]:
    """EasyEdit's teacher-forced token accuracies, in a table of their own (a different metric family)."""
    lines = [
        "",
        "## EasyEdit teacher-forced token accuracy (not comparable with the table above)",
        "",
        "| Editor | rewrite_acc | rephrase_acc | locality | portability |",
        "|---|---|---|---|---|",
    ]
    for name, e in eds.items():
        q = e["summary"]["easyedit"]
        lines.append(
            f"| {name} | {_f(q['rewrite_acc'])} | {_f(q['rephrase_acc'])} | {_f(q['locality'])} | {_f(q['portability'])} |"
        )
    return lines


def _locality_state_lines(eds: Mapping[str, Any]) -> list[str]:
    """Drift of the final hidden state and next-token agreement on the locality prompts."""
    lines = ["", "## Locality states", "", "| Editor | mean drift | median drift | next-token agreement |", "|---|---|---|---|"]
    for name, e in eds.items():
        ls = e["summary"]["locality_states"]
        d = ls.get("drift") or {}
        lines.append(f"| {name} | {_f(d.get('mean'), 4)} | {_f(d.get('median'), 4)} | {_f(ls.get('next_token_agreement'))} |")
    return lines


def _diagnostic_lines(eds: Mapping[str, Any]) -> list[str]:
    """The gate diagnostics of the editors with slots; nothing when none has them."""
    diag = [(n, e["summary"]["diagnostics"]) for n, e in eds.items() if "diagnostics" in e["summary"]]
    if not diag:
        return []
    lines = [
        "",
        # every editor is scored with the same threshold, so the first one's stands for all
        f"## Mechanism diagnostics (open = gate >= {diag[0][1]['open_threshold']})",
        "",
        "| Editor | request gate (mean / median) | request open | dominates | rephrase gate (mean) | "
        "rephrase open | locality max gate (mean) | locality open | efficacy misses: address / write | "
        "generalization misses: address / write | generalization hits with own gate shut |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, d in diag:
        rg, pg, lg = d["request_matched_gate"] or {}, d["rephrase_matched_gate"] or {}, d["locality_max_gate"] or {}
        fe, fg = d["failures"]["efficacy"], d["failures"]["generalization"]
        lines.append(
            f"| {name} | {_f(rg.get('mean'))} / {_f(rg.get('median'))} | {_f(d['request_gate_open'])} | "
            f"{_f(d['matched_slot_dominates'])} | {_f(pg.get('mean'))} | {_f(d['rephrase_gate_open'])} | "
            f"{_f(lg.get('mean'))} | {_f(d['locality_gate_open'])} | {fe['address']} / {fe['write']} of "
            f"{fe['misses']} | {fg['address']} / {fg['write']} of {fg['misses']} | "
            f"{d.get('hits_own_gate_shut', {}).get('generalization', '–')} |"
        )
    return lines


def _editor_info_lines(eds: Mapping[str, Any]) -> list[str]:
    """Each editor's settings (its timings apart) and how long it took; the report ends with a blank line."""
    info_lines = []
    for name, e in eds.items():
        inf = {k: v for k, v in e["info"].items() if k != "timings"}
        t = e["info"].get("timings", {})
        info_lines.append(f"- **{name}**: {json.dumps(inf, ensure_ascii=False)}; time {t.get('total_s', 0):.1f} s")
    return ["", "## Editors", ""] + info_lines + [""]


# =============================================================================
# Command line
# =============================================================================
