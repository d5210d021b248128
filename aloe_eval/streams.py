"""Development streams longer than one benchmark split, kept disjoint from the construction corpus.

The build mines negatives and trains its address encoder on a construction corpus
(:mod:`aloe_build.corpus`, by default the first 4,000 records of CounterFact train). A stream
that shared a record, a case id or a (subject, prompt) pair with it would be edited on states
the build has seen as negatives, so :func:`disjoint_stream` drops every such record, and any
later record that repeats an earlier one's prompt (a second target for the same prompt is an
update, not a new edit), and reports what it dropped and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from aloe_build.data import EditRequest


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
    return ({str(r.id) for r in corpus if r.id is not None}, {(r.subject, r.prompt) for r in corpus},
            {(r.prompt, r.target_new, r.subject) for r in corpus})


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


def disjoint_stream(sources: Sequence[tuple[str, Sequence[EditRequest]]], corpus: Sequence[EditRequest]
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
