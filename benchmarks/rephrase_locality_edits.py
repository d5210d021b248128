"""Edits whose locality prompts are rewordings about subjects nobody edited: do slots leak?

A benchmark's locality prompts are usually in the request's own template (CounterFact's
neighbourhood prompts), which the build's negatives cover closely. A served model is also asked
in other words about subjects that were never edited. This script rewrites the first ``--limit``
edits of a file so that each edit's locality prompts are the rephrases of records *after* the
edited ones (skipping any whose subject is an edited subject), each with that record's ground
truth. ``aloe eval`` on the result reports, under "Loc.", the share of those rewordings whose
answer is unchanged; its diagnostics say how often some slot's gate opens on them. Efficacy and
generalization are those of the original edits.

    python benchmarks/rephrase_locality_edits.py ../shared/data/counterfact/counterfact-val.json \
        --limit 1301 --out runs/counterfact-val-rephrase-locality.jsonl
    aloe eval --model smollm2 --operator runs/cf --edits runs/counterfact-val-rephrase-locality.jsonl --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from aloe_build.data import LocalityPrompt, load_edits, save_edits_jsonl

KIND = "unedited_rephrase"


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("edits", help="any edit file aloe_build.load_edits reads, with rephrases")
    ap.add_argument("--limit", type=int, required=True, help="the first N records are the edits; the rest give the prompts")
    ap.add_argument("--out", required=True, help="JSONL file to write (our own format)")
    ap.add_argument("--skip-invalid", action="store_true", help="skip records load_edits rejects")
    args = ap.parse_args(argv)
    records = load_edits(args.edits, skip_invalid=args.skip_invalid)
    edits, rest = records[: args.limit], records[args.limit:]
    subjects = {e.subject for e in edits}
    prompts = [LocalityPrompt(p, r.ground_truth, KIND) for r in rest if r.subject not in subjects for p in r.rephrases]
    if not prompts:
        raise SystemExit(f"no rephrases of unedited subjects after record {args.limit} of {args.edits}")
    # dealt out in turn: every prompt used, each edit given the same count or one less
    rewritten = [dataclasses.replace(e, locality=tuple(prompts[i::len(edits)]), portability=())
                 for i, e in enumerate(edits)]
    path = save_edits_jsonl(rewritten, args.out)
    print(f"wrote {len(rewritten)} edits with {len(prompts)} rewordings of unedited subjects as locality prompts to {path}")
    return path


if __name__ == "__main__":
    main()
