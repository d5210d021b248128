"""Where an operator's locality misses come from, read off an evaluation's per-edit rows.

Each locality prompt whose greedy answer changed is put in one class by the slot with the largest
gate on it: no gate open; the edit's own slot; another slot whose request is that very prompt (the
operator edits that fact, so its answer is meant to change: large CounterFact streams edit some of
their own neighbourhood prompts); another slot. Also prints the paper's locality with the prompts of
the third class left out.

    python -m benchmarks.locality_failures --operator runs/cf4000 --eval runs/cf4000/eval
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter
from pathlib import Path

from aloe_eval.summary import locality_outside_stream
from aloe_kernels import AloeOperator

CLASSES = ("no gate open", "own slot", "another slot, asked as its request", "another slot")


def classify(rows: list[dict], requests: list[str]) -> tuple[Counter, int, float | None]:
    """Counts of changed locality prompts per class, the number of prompts, and locality without
    the prompts some slot asks as its request (mean per edit, then over edits)."""
    counts: Counter = Counter()
    prompts = 0
    for r in rows:
        for x in r["locality_prompts"]:
            prompts += 1
            if x["stable"] >= 1:
                continue
            slot, gate = x.get("max_slot"), x.get("max_gate") or 0.0
            if slot is None or gate <= 0:
                counts[CLASSES[0]] += 1
            elif slot == r["slot"]:
                counts[CLASSES[1]] += 1
            elif requests[slot] == x["prompt"]:
                counts[CLASSES[2]] += 1
            else:
                counts[CLASSES[3]] += 1
    return counts, prompts, locality_outside_stream(rows, set(requests))[0]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--operator", required=True, help="the operator the evaluation scored")
    ap.add_argument("--eval", required=True, help="directory of the evaluation (eval_rows.jsonl.gz)")
    ap.add_argument("--editor", default="ALOE")
    args = ap.parse_args(argv)
    op = AloeOperator.load(args.operator)
    requests = [e.get("request") for e in op.edits]
    with gzip.open(Path(args.eval) / "eval_rows.jsonl.gz", "rt") as f:
        rows = [r["row"] for r in map(json.loads, f) if r["editor"] == args.editor]
    counts, prompts, outside = classify(rows, requests)
    out = {"operator_slots": op.n, "edits_scored": len(rows), "locality_prompts": prompts,
           "changed": sum(counts.values()), **{c: counts.get(c, 0) for c in CLASSES},
           "locality_without_prompts_asked_by_a_slot": outside}
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
