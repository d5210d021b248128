"""Helpers shared by the per-format record parsers.

:class:`_Ctx` says where a record came from (file, index, JSONL line, id) and builds
the :class:`~.requests.EditDataError` that names it; the other helpers read one field
of a raw record and raise such an error, naming the field, when it is missing or
malformed.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .requests import EditDataError, _str_tuple, normalize_answers


class _Ctx:
    """Where a record came from, for error messages."""

    def __init__(self, path: Path, index: int, lineno: int | None, rec_id: str | None) -> None:
        self.path, self.index, self.lineno, self.rec_id = path, index, lineno, rec_id

    def __str__(self) -> str:
        s = f"{self.path}: record {self.index}"
        if self.lineno is not None:
            s += f" (line {self.lineno})"
        if self.rec_id is not None:
            s += f" [id {self.rec_id}]"
        return s

    def error(self, msg: str) -> EditDataError:
        return EditDataError(f"{self}: {msg}")


def _get(rec: Mapping[str, Any], key: str, ctx: _Ctx) -> Any:
    if key not in rec:
        raise ctx.error(f"missing required field '{key}' (fields seen: {sorted(rec)})")
    return rec[key]


def _req_str(rec: Mapping[str, Any], key: str, ctx: _Ctx, what: str | None = None, allow_empty: bool = False) -> str:
    value = _get(rec, key, ctx)
    label = f"'{key}'" + (f" ({what})" if what else "")
    if not isinstance(value, str):
        raise ctx.error(f"field {label} must be a string, got {type(value).__name__}: {str(value)[:80]}")
    if not allow_empty and not value.strip():
        raise ctx.error(f"field {label} is empty")
    return value


def _opt_strs(rec: Mapping[str, Any], key: str, ctx: _Ctx) -> tuple[str, ...]:
    try:
        return _str_tuple(rec.get(key), key)
    except TypeError as e:
        raise ctx.error(str(e)) from None


def _answers(value: Any, ctx: _Ctx, key: str) -> tuple[str, ...] | None:
    try:
        return normalize_answers(value)
    except TypeError as e:
        raise ctx.error(f"field '{key}': {e}") from None


def _prompt_groups(value: Any, ctx: _Ctx, key: str, cls: type) -> list:
    """KnowEdit ``{"Relation_Specificity": [{prompt, ground_truth}, ...], ...}`` -> prompt objects."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise ctx.error(f"field '{key}' must be an object of lists, got {type(value).__name__}")
    out = []
    for group, entries in value.items():
        kind = str(group).strip().lower()
        if isinstance(entries, Mapping):
            entries = [entries]
        if not isinstance(entries, list):
            raise ctx.error(f"field '{key}.{group}' must be a list, got {type(entries).__name__}")
        for j, e in enumerate(entries):
            if isinstance(e, str):
                e = {"prompt": e}
            if not isinstance(e, Mapping) or "prompt" not in e:
                raise ctx.error(f"field '{key}.{group}[{j}]' must be an object with a 'prompt'")
            p = e["prompt"]
            if isinstance(p, list):  # some EasyEdit files wrap a single prompt in a list
                p = " ".join(x for x in p if isinstance(x, str))
            if not isinstance(p, str):
                raise ctx.error(f"field '{key}.{group}[{j}].prompt' must be a string")
            if not p.strip():
                continue
            out.append(cls(p, _answers(e.get("ground_truth"), ctx, f"{key}.{group}[{j}].ground_truth"), kind))
    return out
