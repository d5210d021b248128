"""KnowEdit parsers: ZsRE, WikiData_counterfact, WikiData_recent and WikiBio.

``knowedit_zsre``: ``subject``, ``prompt``, ``target_new``, ``ground_truth`` (list),
``rephrase_prompt``, ``locality{...}``, ``portability{...}``.
``knowedit_wikidata_counterfact`` (``train_cf.json``): as above with a string
``ground_truth`` and no rephrase. ``knowedit_wikidata_recent`` (``recent_train.json``):
no ``ground_truth`` (the fact is new). ``knowedit_wikibio``: ``text``, ``labels``,
``concept``, ``locality{...}``.

Decisions worth knowing:

* KnowEdit ``locality``/``portability`` keys are lower-cased into ``kind``
  (``"relation_specificity"``, ``"forgetfulness"``, ``"reasoning"``,
  ``"subject_aliasing"``, ``"logical_generalization"``).
* WikiBio: ``prompt`` = ``text`` (the passage), ``target_new`` = ``labels`` (the
  sentence to append), ``subject`` = ``concept``; no ground truth.
* Ground truths (also those of locality/portability prompts) may be lists of lists
  (alias lists); they are flattened (see :func:`~.requests.normalize_answers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .fields import _answers, _Ctx, _opt_strs, _prompt_groups, _req_str
from .requests import EditRequest, LocalityPrompt, PortabilityPrompt


def _parse_knowedit(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    return EditRequest(
        prompt=_req_str(rec, "prompt", ctx),
        target_new=_req_str(rec, "target_new", ctx),
        subject=_req_str(rec, "subject", ctx),
        ground_truth=_answers(rec.get("ground_truth"), ctx, "ground_truth"),
        rephrases=_opt_strs(rec, "rephrase_prompt", ctx),
        locality=tuple(_prompt_groups(rec.get("locality"), ctx, "locality", LocalityPrompt)),
        portability=tuple(_prompt_groups(rec.get("portability"), ctx, "portability", PortabilityPrompt)),
        id=ctx.rec_id,
        relation=rec.get("relation_id") or None,
        source=fmt,
    )


def _parse_wikibio(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    return EditRequest(
        prompt=_req_str(rec, "text", ctx, "prompt"),
        target_new=_req_str(rec, "labels", ctx, "target_new"),
        subject=_req_str(rec, "concept", ctx, "subject"),
        locality=tuple(_prompt_groups(rec.get("locality"), ctx, "locality", LocalityPrompt)),
        id=ctx.rec_id,
        source=fmt,
    )
