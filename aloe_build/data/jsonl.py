"""Our own format (``aloe_jsonl``): one object per line with the :class:`EditRequest`
field names, read by :func:`_parse_aloe` and written by :func:`save_edits_jsonl`.

Records carry ``prompt``, ``target_new``, ``subject`` and optionally
``ground_truth``, ``rephrases``, ``locality``, ``portability``,
``generation_prompts``, ``id``, ``relation`` and ``source`` (any other field is an
error). Locality/portability entries may be bare prompt strings or
``{prompt, ground_truth, kind}`` objects. A stored ``source`` is kept, so a file
written from another format round-trips.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .fields import _answers, _Ctx, _opt_strs, _req_str
from .requests import _ALOE_FIELDS, EditRequest, LocalityPrompt, PathLike, PortabilityPrompt


def _parse_aloe(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    unknown = sorted(set(rec) - _ALOE_FIELDS)
    if unknown:
        raise ctx.error(f"unknown field(s) {unknown} for the aloe_jsonl format; allowed: {sorted(_ALOE_FIELDS)}")
    prompt = _req_str(rec, "prompt", ctx)
    target = _req_str(rec, "target_new", ctx)
    subject = _req_str(rec, "subject", ctx, allow_empty=True)
    try:
        loc = tuple(LocalityPrompt.from_obj(x) for x in _as_list(rec.get("locality")))
        port = tuple(PortabilityPrompt.from_obj(x) for x in _as_list(rec.get("portability")))
    except (TypeError, ValueError) as e:
        raise ctx.error(str(e)) from None
    source = rec.get("source")
    return EditRequest(
        prompt=prompt,
        target_new=target,
        subject=subject,
        ground_truth=_answers(rec.get("ground_truth"), ctx, "ground_truth"),
        rephrases=_opt_strs(rec, "rephrases", ctx),
        locality=loc,
        portability=port,
        generation_prompts=_opt_strs(rec, "generation_prompts", ctx),
        id=ctx.rec_id,
        relation=rec.get("relation") or None,
        source=source if isinstance(source, str) and source else fmt,
    )


def _as_list(v: Any) -> list:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v]


def save_edits_jsonl(requests: Iterable[EditRequest], path: PathLike) -> Path:
    """Write edits as our own JSONL format (one :meth:`EditRequest.to_dict` object per line).

    The file round-trips through :func:`load_edits`: the edits compare equal, provided
    each has an ``id`` and a ``source`` (on reload an edit without an id gets
    ``"<file stem>-<index>"``, and one without a source gets ``"aloe_jsonl"``).
    Parent folders are created. Returns the path written.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in requests:
            if not isinstance(r, EditRequest):
                raise TypeError(f"save_edits_jsonl expects EditRequest objects, got {type(r).__name__}")
            f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
    os.replace(tmp, p)
    return p
