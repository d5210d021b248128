"""The MEND zsRE parser (``zsre_mend``).

Records: ``subject``, ``src`` (the prompt), ``alt`` (the new target), ``answers``
(the old ones), ``rephrase``, ``loc`` ("nq question: ..."), ``loc_ans``. There is
no ``case_id``: ids are ``f"{file stem}-{index}"``.

Decisions worth knowing:

* zsRE ``loc`` prompts are Natural Questions prompts of the form
  ``"nq question: who plays ..."``; the ``"nq question: "`` prefix is removed and
  the question is kept verbatim (lower-case, no question mark added), with
  ``kind="nq"`` so that evaluations can still tell them apart.

Some published files have records with an empty ``alt`` (two in
``zsre_mend_train-1k.json``); load them with ``skip_invalid=True``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .fields import _answers, _Ctx, _opt_strs, _req_str
from .requests import EditRequest, LocalityPrompt

_NQ_PREFIX = "nq question: "


def _parse_zsre(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    loc = []
    lq = rec.get("loc")
    if isinstance(lq, str) and lq.strip():
        q = lq[len(_NQ_PREFIX) :] if lq.startswith(_NQ_PREFIX) else lq
        if q.strip():
            loc.append(LocalityPrompt(q, _answers(rec.get("loc_ans"), ctx, "loc_ans"), "nq"))
    return EditRequest(
        prompt=_req_str(rec, "src", ctx, "prompt"),
        target_new=_req_str(rec, "alt", ctx, "target_new"),
        subject=_req_str(rec, "subject", ctx),
        ground_truth=_answers(rec.get("answers"), ctx, "answers"),
        rephrases=_opt_strs(rec, "rephrase", ctx),
        locality=tuple(loc),
        id=ctx.rec_id,
        source=fmt,
    )
