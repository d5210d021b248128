"""The prompts of the scope probes (``subject_key_reach``, ``subject_readout``): per edit of a tuning slice,
where its fact is asked and where it is not, and where its subject's tokens sit in each.

Kinds: ``request``; ``rephrase`` (the stream's rewordings); ``in_context`` (the request after one held-out
sentence, as ``aloe eval`` asks it); ``distracted`` (the edit's statement, then its locality prompt or
another edit's request); ``same_subject`` (another edit's request with its subject swapped for this one:
the same subject asked another relation); ``neighbour`` (the locality prompt alone).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from typing import Any, Sequence

import torch

from aloe_build.data import fact_statement
from aloe_eval.in_context import request_in_context

POSITIVE_KINDS = ("request", "rephrase", "in_context")


def scope_prompts(edits: Sequence[Any], seed: int = 0) -> list[tuple[int, str, str]]:
    """``(edit index, kind, text)`` for every edit (four other edits drawn per edit with ``seed``)."""
    rng = random.Random(seed)
    rows: list[tuple[int, str, str]] = []
    for i, e in enumerate(edits):
        stmt = fact_statement(e.prompt, e.target_new)
        others = [edits[j] for j in rng.sample(range(len(edits)), 6) if j != i][:4]
        rows.append((i, "request", e.prompt))
        rows += [(i, "rephrase", t) for t in e.rephrases]
        rows += [(i, "in_context", t) for t in request_in_context(e.prompt, i)]
        rows += [(i, "distracted", f"{stmt} {lp.prompt}") for lp in e.locality]
        rows += [(i, "distracted", f"{stmt} {o.prompt}") for o in others]
        rows += [
            (i, "same_subject", o.prompt.replace(o.subject, e.subject)) for o in others[:3] if o.subject and o.subject in o.prompt
        ]
        rows += [(i, "neighbour", lp.prompt) for lp in e.locality]
    return rows


def subject_token_positions(tokenizer, text: str, subject: str) -> tuple[list[int], list[int]]:
    """Prompt ids of ``text`` and the index of the last token of each occurrence of ``subject``
    (case-insensitive; none when absent). Needs a fast tokenizer (offsets)."""
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=True)
    ids, offsets = list(enc["input_ids"]), enc["offset_mapping"]
    low, sub = text.lower(), subject.lower().strip()
    found, start = [], 0
    while sub:
        k = low.find(sub, start)
        if k < 0:
            break
        end = k + len(sub)
        ends_inside = [i for i, (_, b) in enumerate(offsets) if k < b <= end]
        if ends_inside:
            found.append(max(ends_inside))
        start = end
    return ids, found


def auc(pos: Sequence[float], neg: Sequence[float]) -> float | None:
    """P(a positive scores above a negative), ties counted half; None when either side is empty."""
    if not len(pos) or not len(neg):
        return None
    p, n = torch.as_tensor(list(pos)), torch.as_tensor(list(neg))
    return float(((p[:, None] > n[None]).float() + 0.5 * (p[:, None] == n[None]).float()).mean())


def slice_parser(doc: str) -> argparse.ArgumentParser:
    """The options every scope probe takes: the tuning slice, the edited layer and the output file."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--edits", required=True, help="edit file of the tuning slice")
    ap.add_argument("--skip-invalid", action="store_true", help="skip records without a usable target")
    ap.add_argument("--start", type=int, default=1500, help="first record of the slice")
    ap.add_argument("--n", type=int, default=100, help="records in the slice")
    ap.add_argument("--l2", type=int, default=22, help="the edited layer, where the address reads")
    ap.add_argument("--out", required=True, help="JSON file to write")
    return ap


def save_result(result: dict, module: str, argv: list[str] | None, out: str) -> None:
    """Write a probe's ``result`` to ``out`` as JSON, with the command that produced it."""
    result["command"] = " ".join([f"python -m {module}", *(argv if argv is not None else sys.argv[1:])])
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
