"""Evaluation streams made from edit files.

Three command-line tools, each writing an edit file in our JSONL format for ``aloe build`` and
``aloe eval``:

* ``counterfact``: the CounterFact development stream for builds at scale (about 7,900 edits):
  CounterFact val first (so that its first 839 edits are, but for the records dropped, the
  839-edit development stream), then the CounterFact train records the construction corpus does
  not use. The build mines negatives and trains its address encoder on that corpus
  (:mod:`aloe_build.corpus`, by default the first 4,000 records of CounterFact train); a stream
  sharing a record, a case id or a (subject, prompt) pair with it would be edited on states the
  build has seen as negatives, so :func:`disjoint_stream` drops every such record, and any later
  record repeating an earlier one's prompt (a second target for the same prompt is an update,
  not a new edit); the report beside the stream counts each reason.
* ``in-context``: does an edit fire in context? Each edit's rephrases become its own request
  after fixed unrelated sentences (:func:`aloe_eval.in_context.in_context`); "Gen." of
  ``aloe eval`` on the result is the share of in-context requests that give the target.
* ``rephrase-locality``: do slots leak onto rewordings about subjects nobody edited? The first
  ``--limit`` records are the edits; their locality prompts become the rephrases of the later
  records (skipping edited subjects), each with that record's ground truth; "Loc." of
  ``aloe eval`` on the result is the share of those rewordings left unchanged.

::

    python -m aloe_eval.streams counterfact --data $DATA/counterfact --out runs/cf-stream.jsonl
    python -m aloe_eval.streams in-context $DATA/counterfact/counterfact-val.json --limit 839 \\
        --out runs/counterfact-val-in-context.jsonl
    python -m aloe_eval.streams rephrase-locality $DATA/counterfact/counterfact-val.json --limit 1301 \\
        --out runs/counterfact-val-rephrase-locality.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from aloe_build.corpus import default_corpus_path
from aloe_build.data import EditRequest, LocalityPrompt, load_edits, save_edits_jsonl

from .in_context import IN_CONTEXT_PER_EDIT, request_in_context

REPHRASE_LOCALITY_KIND = "unedited_rephrase"


@dataclass
class StreamReport:
    """What :func:`disjoint_stream` kept and dropped, per source and reason."""

    kept: int = 0
    sources: dict[str, int] = field(default_factory=dict)  # records read per source
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> count
    checks: dict[str, int] = field(default_factory=dict)  # overlaps left in the result (all zero)

    def to_dict(self) -> dict:
        return {"kept": self.kept, "sources": self.sources, "dropped": self.dropped, "checks": self.checks}


def _corpus_keys(corpus: Sequence[EditRequest]) -> tuple[set[str], set[tuple], set[tuple]]:
    """The corpus's case ids, (subject, prompt) pairs and (prompt, target, subject) records."""
    return (
        {str(r.id) for r in corpus if r.id is not None},
        {(r.subject, r.prompt) for r in corpus},
        {(r.prompt, r.target_new, r.subject) for r in corpus},
    )


def _overlaps(stream: Sequence[EditRequest], keys: tuple[set[str], set[tuple], set[tuple]]) -> dict[str, int]:
    """Counts of stream records that share something with the corpus (each should be 0)."""
    ids, pairs, records = keys
    return {
        "case_id_in_corpus": sum(r.id is not None and str(r.id) in ids for r in stream),
        "subject_prompt_pair_in_corpus": sum((r.subject, r.prompt) in pairs for r in stream),
        "record_in_corpus": sum((r.prompt, r.target_new, r.subject) in records for r in stream),
        "repeated_prompt": len(stream) - len({r.prompt for r in stream}),
        "repeated_id": len(stream) - len({str(r.id) for r in stream}),
    }


def disjoint_stream(
    sources: Sequence[tuple[str, Sequence[EditRequest]]], corpus: Sequence[EditRequest]
) -> tuple[list[EditRequest], StreamReport]:
    """The records of ``sources`` (name, records), in order, without any that the corpus holds (same
    case id, same (subject, prompt) pair, or the same record) and without repeats of an earlier
    prompt or id; the report counts each reason and re-checks the result against the corpus."""
    keys = _corpus_keys(corpus)
    ids, pairs, records = keys
    report = StreamReport()
    seen_prompts: set[str] = set()
    seen_ids: set[str] = set()
    out: list[EditRequest] = []

    def drop(reason: str) -> None:
        report.dropped[reason] = report.dropped.get(reason, 0) + 1

    for name, recs in sources:
        report.sources[name] = len(recs)
        for r in recs:
            rid = None if r.id is None else str(r.id)
            if rid is not None and rid in ids:
                drop("case_id_in_corpus")
            elif (r.prompt, r.target_new, r.subject) in records:
                drop("record_in_corpus")
            elif (r.subject, r.prompt) in pairs:
                drop("subject_prompt_pair_in_corpus")
            elif r.prompt in seen_prompts:
                drop("repeated_prompt")
            elif rid is not None and rid in seen_ids:
                drop("repeated_id")
            else:
                seen_prompts.add(r.prompt)
                if rid is not None:
                    seen_ids.add(rid)
                out.append(r)
    report.kept = len(out)
    report.checks = _overlaps(out, keys)
    return out, report


def counterfact_stream(data: str | Path, corpus: str | Path | None = None) -> tuple[list[EditRequest], StreamReport]:
    """CounterFact val then train (``counterfact-val.json``, ``counterfact-train.json`` in ``data``),
    disjoint from the construction corpus (default: the bundled one)."""
    data = Path(data)
    sources = [
        ("counterfact-val", load_edits(data / "counterfact-val.json")),
        ("counterfact-train", load_edits(data / "counterfact-train.json")),
    ]
    return disjoint_stream(sources, load_edits(corpus or default_corpus_path()))


def in_context_edits(edits: Sequence[EditRequest]) -> list[EditRequest]:
    """Each edit with its rephrases replaced by the in-context forms of its request that ``aloe eval``
    scores (:func:`aloe_eval.in_context.request_in_context`) and no portability prompts; locality is kept."""
    return [dataclasses.replace(e, rephrases=request_in_context(e.prompt, i), portability=()) for i, e in enumerate(edits)]


def rephrase_locality_edits(records: Sequence[EditRequest], limit: int) -> list[EditRequest]:
    """The first ``limit`` records, each with the rephrases of the later records about subjects none
    of them edits as its locality prompts (dealt out in turn: every rewording used, each edit given
    the same count or one less) and no portability prompts."""
    edits, rest = records[:limit], records[limit:]
    subjects = {e.subject for e in edits}
    prompts = [
        LocalityPrompt(p, r.ground_truth, REPHRASE_LOCALITY_KIND) for r in rest if r.subject not in subjects for p in r.rephrases
    ]
    if not prompts:
        raise ValueError(f"no rephrases of unedited subjects after record {limit}")
    return [dataclasses.replace(e, locality=tuple(prompts[i :: len(edits)]), portability=()) for i, e in enumerate(edits)]


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(prog="python -m aloe_eval.streams", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="stream", required=True)
    p = sub.add_parser("counterfact", help="CounterFact val + train, disjoint from the construction corpus")
    p.add_argument("--data", required=True, help="directory with counterfact-val.json and counterfact-train.json")
    p.add_argument("--corpus", default=None, help="construction corpus (default: the bundled one)")
    p.add_argument("--out", required=True, help="JSONL file to write; the report goes to <out>.report.json")
    for name, text in (
        ("in-context", "each request after unrelated text as the rephrases"),
        ("rephrase-locality", "rewordings of later, unedited subjects as the locality prompts"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("edits", help="any edit file aloe_build.load_edits reads")
        p.add_argument("--out", required=True, help="JSONL file to write (our own format)")
        p.add_argument("--skip-invalid", action="store_true", help="skip records load_edits rejects")
        if name == "in-context":
            p.add_argument("--limit", type=int, default=None, help="first N records only")
        else:
            p.add_argument(
                "--limit", type=int, required=True, help="the first N records are the edits; the rest give the prompts"
            )
    args = ap.parse_args(argv)
    if args.stream == "counterfact":
        stream, report = counterfact_stream(args.data, args.corpus)
        if any(report.checks.values()):  # pragma: no cover - disjoint_stream removes every overlap
            raise SystemExit(f"stream still overlaps the corpus: {report.checks}")
        path = save_edits_jsonl(stream, args.out)
        Path(f"{path}.report.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n")
        print(f"wrote {report.kept} edits to {path}; dropped {report.dropped}; checks {report.checks}")
    elif args.stream == "in-context":
        edits = in_context_edits(load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid))
        path = save_edits_jsonl(edits, args.out)
        print(f"wrote {len(edits)} edits with {IN_CONTEXT_PER_EDIT} in-context requests each to {path}")
    else:
        try:
            edits = rephrase_locality_edits(load_edits(args.edits, skip_invalid=args.skip_invalid), args.limit)
        except ValueError as exc:
            raise SystemExit(f"{exc} of {args.edits}") from None
        path = save_edits_jsonl(edits, args.out)
        n = sum(len(e.locality) for e in edits)
        print(f"wrote {len(edits)} edits with {n} rewordings of unedited subjects as locality prompts to {path}")
    return path


if __name__ == "__main__":
    main()
