"""Format detection: which of :data:`FORMATS` a record (and so a file) is in.

A file's format is that of its first record; see the package docstring for the
fields each format is recognised by.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from .requests import _ALOE_FIELDS, EditDataError

#: Every format name :func:`detect_format` can return.
FORMATS: tuple[str, ...] = (
    "counterfact_rome",
    "counterfact_easyedit",
    "zsre_mend",
    "knowedit_zsre",
    "knowedit_wikidata_counterfact",
    "knowedit_wikidata_recent",
    "knowedit_wikibio",
    "aloe_jsonl",
)

# What each format is recognised by (used in the "unrecognised format" message).
_EXPECTED_FIELDS: dict[str, str] = {
    "counterfact_rome": "requested_rewrite{prompt, subject, target_new{str}, target_true{str}}, "
    "paraphrase_prompts, neighborhood_prompts",
    "counterfact_easyedit": "prompt, subject, target_new, ground_truth, rephrase_prompt, locality_prompt, locality_ground_truth",
    "zsre_mend": "subject, src, alt, answers, rephrase, loc, loc_ans",
    "knowedit_*": "subject, prompt, target_new, locality{...} and/or portability{...} (+ ground_truth, rephrase_prompt)",
    "knowedit_wikibio": "text, labels, concept, locality{...}",
    "aloe_jsonl": "prompt, target_new, subject (+ ground_truth, rephrases, locality, "
    "portability, generation_prompts, id, relation, source)",
}


def _detect_one(rec: Mapping[str, Any]) -> str | None:
    """The format of one record, or None when it matches none."""
    keys = set(rec)
    if "requested_rewrite" in keys:
        return "counterfact_rome"
    if "src" in keys and ("alt" in keys or "loc" in keys):
        return "zsre_mend"
    if {"text", "labels", "concept"} <= keys:
        return "knowedit_wikibio"
    if "prompt" in keys and "target_new" in keys:
        if isinstance(rec.get("locality"), Mapping) or isinstance(rec.get("portability"), Mapping):
            if "rephrase_prompt" in keys:
                return "knowedit_zsre"
            if "ground_truth" in keys:
                return "knowedit_wikidata_counterfact"
            return "knowedit_wikidata_recent"
        if keys & {"rephrase_prompt", "locality_prompt", "locality_ground_truth", "case_id"}:
            return "counterfact_easyedit"
        if keys <= _ALOE_FIELDS:
            return "aloe_jsonl"
    return None


def detect_format(records: Sequence[Any]) -> str:
    """Name the dataset format of ``records`` (parsed JSON records) from the first one.

    Returns one of :data:`FORMATS`. An empty sequence is ``"aloe_jsonl"``.

    Raises:
        EditDataError: when the first record is not an object or matches no known
            format; the message lists the fields seen and those each format expects.
    """
    if len(records) == 0:
        return "aloe_jsonl"
    return _detect_record(records[0], "record 0")


def _detect_record(rec: Any, where: str) -> str:
    if not isinstance(rec, Mapping):
        raise EditDataError(f"{where}: expected a JSON object, got a JSON {type(rec).__name__}: {str(rec)[:80]}")
    fmt = _detect_one(rec)
    if fmt is None:
        expected = "; ".join(f"{k}: {v}" for k, v in _EXPECTED_FIELDS.items())
        raise EditDataError(f"{where}: unrecognised edit format; fields seen: {sorted(rec)}; expected one of: {expected}")
    return fmt
