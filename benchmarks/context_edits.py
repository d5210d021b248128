"""Edits whose rephrases are the request after unrelated text: does an edit fire in context?

A deployed model rarely sees a request on its own: a system prompt, a conversation or a
document comes first. This script rewrites an edit file so that each edit's rephrases are
its own request after fixed sentences written for this check (``aloe_eval.in_context.PREFIXES``;
none comes from the construction corpus, whose statements the build puts before requests), keeping its
locality prompts. ``aloe eval`` on the result reports, under "Gen.", the share of those
in-context requests that give the target.

    python benchmarks/context_edits.py ../shared/data/counterfact/counterfact-val.json \
        --limit 839 --out runs/counterfact-val-in-context.jsonl
    aloe eval --model smollm2 --operator runs/cf --edits runs/counterfact-val-in-context.jsonl --out DIR
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from aloe_build.data import load_edits, save_edits_jsonl
from aloe_eval.in_context import in_context

PER_EDIT = 2  # in-context requests per edit, taking the prefixes in turn


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("edits", help="any edit file aloe_build.load_edits reads")
    ap.add_argument("--out", required=True, help="JSONL file to write (our own format)")
    ap.add_argument("--limit", type=int, default=None, help="first N records only")
    ap.add_argument("--skip-invalid", action="store_true", help="skip records load_edits rejects")
    args = ap.parse_args(argv)
    edits = load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid)
    rewritten = [dataclasses.replace(e, rephrases=in_context(e.prompt, PER_EDIT, PER_EDIT * i), portability=())
                 for i, e in enumerate(edits)]
    path = save_edits_jsonl(rewritten, args.out)
    print(f"wrote {len(rewritten)} edits with {PER_EDIT} in-context requests each to {path}")
    return path


if __name__ == "__main__":
    main()
