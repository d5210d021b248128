"""Per-editor summaries and plot data from the per-edit rows."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from aloe_build.forward import TFResult

from .editors import Editor
from .metrics import dist, mean, share
from .plan import EditPlan


def _macro_by_kind(rows: list[dict], list_key: str, value_key: str) -> dict[str, float]:
    per_kind: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        groups: dict[str, list[float]] = defaultdict(list)
        for x in row[list_key]:
            if x.get(value_key) is not None:
                groups[x["kind"]].append(x[value_key])
        for kind, vals in groups.items():
            per_kind[kind].append(sum(vals) / len(vals))
    return {k: sum(v) / len(v) for k, v in sorted(per_kind.items())}


def row_statistics(rows: list[dict], slots: bool) -> dict[str, Any]:
    """The per-prompt statistics the summary and the gate plots are made of, read off the rows:
    matched gates and dominance of requests and rephrases, address/write failure counts, and over
    the unique locality prompts (same prompt, same number of tokens) their max gate, drift and
    next-token agreement. Rows of separately scored chunks of a stream give the same numbers as
    the rows of one pass."""
    st: dict[str, Any] = {
        "req_gates": [],
        "dominates": [],
        "reph_gates": [],
        "reph_dominates": [],
        "loc_max": [],
        "drifts": [],
        "agree": [],
        "fail": {"efficacy": defaultdict(int), "generalization": defaultdict(int)},
    }
    seen: set[tuple[str, int]] = set()
    for r in rows:
        if slots:
            st["req_gates"].append(r["request_gate"])
            st["dominates"].append(r["request_dominates"])
            if r["request_failure"] is not None:
                st["fail"]["efficacy"][r["request_failure"]] += 1
            for x in r["rephrases"]:
                st["reph_gates"].append(x["gate"])
                st["reph_dominates"].append(x["dominates"])
                if x["failure"] is not None:
                    st["fail"]["generalization"][x["failure"]] += 1
        for lr in r["locality_prompts"]:
            key = (lr["prompt"], lr["k"])
            if key in seen:
                continue
            seen.add(key)
            st["agree"].append(bool(lr["next_token_agree"]))
            if "drift" in lr:
                st["drifts"].append(lr["drift"])
            if slots:
                st["loc_max"].append(lr["max_gate"] or 0.0)
    return st


def locality_outside_stream(rows: list[dict], requests: set[str] | None = None) -> tuple[float | None, int]:
    """``paper.locality`` without the locality prompts that some edit of the stream asks as its
    request (CounterFact's neighbourhood prompts of one record are other records' requests): the
    mean per edit over its other prompts, then over edits with one, and how many prompts were left out.
    ``requests`` (default: the rows' own) may name a larger set, an operator's edits scored in part."""
    requests = {r["prompt"] for r in rows} if requests is None else requests
    per_edit, left_out = [], 0
    for r in rows:
        kept = [x["stable"] for x in r["locality_prompts"] if x["prompt"] not in requests]
        left_out += len(r["locality_prompts"]) - len(kept)
        if kept:
            per_edit.append(sum(kept) / len(kept))
    return mean(per_edit), left_out


def gate_plot_data(rows: list[dict]) -> dict[str, list[float]]:
    """The gates the plots show: matched gates of requests and rephrases, locality max gates."""
    st = row_statistics(rows, True)
    return {"request": st["req_gates"], "rephrase": st["reph_gates"], "locality_max": st["loc_max"]}


def summarize(rows: list[dict], *, slots: bool, open_threshold: float) -> dict[str, Any]:
    """The summary of one editor: counts, paper metrics, EasyEdit metrics, locality states, diagnostics."""
    st = row_statistics(rows, slots)
    req_gates, reph_gates, loc_max = st["req_gates"], st["reph_gates"], st["loc_max"]
    dominates, reph_dominates, fail = st["dominates"], st["reph_dominates"], st["fail"]
    drifts, agree = st["drifts"], st["agree"]
    n_reph = sum(len(r["rephrases"]) for r in rows)
    n_loc = sum(len(r["locality_prompts"]) for r in rows)
    n_port = sum(len(r["portability_prompts"]) for r in rows)
    outside, edited_in_stream = locality_outside_stream(rows)
    s: dict[str, Any] = {
        "counts": {
            "edits": len(rows),
            "rephrases": n_reph,
            "locality_prompts": n_loc,
            "portability_prompts": n_port,
            "distracted_prompts": sum(len(r.get("distracted_prompts", ())) for r in rows),
            "in_context_prompts": sum(len(r.get("in_context_prompts", ())) for r in rows),
            "edits_with_rephrases": sum(1 for r in rows if r["rephrases"]),
            "edits_with_locality": sum(1 for r in rows if r["locality_prompts"]),
            "edits_with_portability": sum(1 for r in rows if r["portability_prompts"]),
            "locality_prompts_edited_in_stream": edited_in_stream,
        },
        "paper": {
            "efficacy": mean(r["efficacy"] for r in rows),
            "generalization": mean(r["generalization"] for r in rows),
            "in_context": mean(r.get("in_context") for r in rows),
            "locality": mean(r["locality"] for r in rows),
            "locality_outside_stream": outside,
            "portability": mean(r["portability"] for r in rows),
            "distracted_locality": mean(r.get("distracted_locality") for r in rows),
            "distracted_leak": mean(r.get("distracted_leak") for r in rows),
            "locality_by_kind": _macro_by_kind(rows, "locality_prompts", "stable"),
            "portability_by_kind": _macro_by_kind(rows, "portability_prompts", "em"),
        },
        "easyedit": {
            "rewrite_acc": mean(r["rewrite_acc"] for r in rows),
            "rephrase_acc": mean(r["rephrase_acc"] for r in rows),
            "locality": mean(r["locality_tf"] for r in rows),
            "portability": mean(r["portability_tf"] for r in rows),
            "locality_by_kind": _macro_by_kind(rows, "locality_prompts", "tf_stability"),
            "portability_by_kind": _macro_by_kind(rows, "portability_prompts", "tf_acc"),
        },
        "locality_states": {
            "drift": dist(drifts),
            "next_token_agreement": share(agree),
            "n_unique_prompts": len(agree),
        },
    }
    if slots:

        def fails(bucket: str, misses: int) -> dict[str, Any]:
            f = dict(fail[bucket])
            out = {k: int(f.get(k, 0)) for k in ("address", "write", "unmapped")}
            out["misses"] = misses
            return out

        eff_miss = sum(1 for r in rows if r["efficacy"] < 1)
        gen_miss = sum(1 for r in rows for x in r["rephrases"] if x["em"] < 1)
        # right answers although the edit's own gate stayed shut
        eff_shut = sum(1 for r in rows if r["efficacy"] >= 1 and (r["request_gate"] or 0.0) < open_threshold)
        gen_shut = sum(1 for r in rows for x in r["rephrases"] if x["em"] >= 1 and (x["gate"] or 0.0) < open_threshold)
        s["diagnostics"] = {
            "open_threshold": open_threshold,
            "request_matched_gate": dist(req_gates),
            "request_gate_open": share([g >= open_threshold for g in req_gates]),
            "rephrase_matched_gate": dist(reph_gates),
            "rephrase_gate_open": share([g >= open_threshold for g in reph_gates]),
            "matched_slot_dominates": share(dominates),
            "rephrase_matched_slot_dominates": share(reph_dominates),
            "locality_max_gate": dist(loc_max),
            "locality_gate_open": share([g >= open_threshold for g in loc_max]),
            "locality_gate_nonzero": share([g > 0 for g in loc_max]),
            "failures": {"efficacy": fails("efficacy", eff_miss), "generalization": fails("generalization", gen_miss)},
            "hits_own_gate_shut": {"efficacy": eff_shut, "generalization": gen_shut},
            "unmapped_edits": sum(1 for r in rows if r["slot"] is None),
        }
    return s


def heatmap(editor: Editor, plans: list[EditPlan], tf: dict[int, TFResult], size: int) -> dict[str, Any]:
    """Gates of the first ``size`` requests (rows) at the slots of the first ``size`` edits (columns)."""
    sel = plans[:size]
    cols = [editor.slot_of(p.request, p.index) for p in sel]
    matrix = [[tf[p.seq].gate(c) if c is not None else 0.0 for c in cols] for p in sel]
    return {"row_ids": [str(p.request.id) for p in sel], "col_slots": cols, "matrix": matrix}


def pca(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Unedited and edited final states projected on their first two principal components."""
    ref = torch.stack([a for a, _ in pairs]).double()
    ed = torch.stack([b for _, b in pairs]).double()
    both = torch.cat([ref, ed])
    mu = both.mean(0, keepdim=True)
    x = both - mu
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    comps = vh[:2]
    var = s**2
    explained = (var[:2] / var.sum().clamp_min(1e-30)).tolist()
    pr = ((ref - mu) @ comps.T).tolist()
    pe = ((ed - mu) @ comps.T).tolist()
    return {"reference": pr, "edited": pe, "explained": explained}


# =============================================================================
# The public entry point
# =============================================================================
