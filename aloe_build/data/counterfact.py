"""CounterFact parsers: the original ROME layout and EasyEdit's.

``counterfact_rome``: ``requested_rewrite{prompt with "{}", relation_id, subject,
target_new{str}, target_true{str}}``, ``paraphrase_prompts``, ``neighborhood_prompts``,
``attribute_prompts``, ``generation_prompts`` (and ``alternative_subject``).

``counterfact_easyedit`` (also EasyEdit's flat ZsRE): ``case_id``, ``prompt``,
``subject``, ``target_new``, ``ground_truth``, ``rephrase_prompt``,
``locality_prompt``, ``locality_ground_truth`` (and optionally KnowEdit-style
``portability{...}``).

Decisions worth knowing:

* ROME templates carry ``"{}"`` for the subject; it is substituted at load time.
* ROME CounterFact: ``neighborhood_prompts`` become locality prompts of kind
  ``"neighborhood"`` (ground truth: the true object), ``attribute_prompts``
  become locality prompts of kind ``"attribute"`` (other subjects whose true
  object is the new target, so their ground truth is ``target_new``), and
  ``alternative_subject`` becomes a ``"subject_aliasing"`` portability prompt.
  Filter on ``kind`` to reproduce the classic neighbourhood score.
* EasyEdit ``portability{...}`` groups are read as KnowEdit's are (see :mod:`.knowedit`):
  their keys are lower-cased into ``kind``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .fields import _answers, _Ctx, _get, _opt_strs, _prompt_groups, _req_str
from .requests import EditRequest, LocalityPrompt, PortabilityPrompt


def _parse_rome(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    rw = _get(rec, "requested_rewrite", ctx)
    if not isinstance(rw, Mapping):
        raise ctx.error("field 'requested_rewrite' must be an object")
    template = _req_str(rw, "prompt", ctx, "requested_rewrite.prompt")
    subject = _req_str(rw, "subject", ctx, "requested_rewrite.subject")
    if "{}" not in template:
        raise ctx.error(f"field 'requested_rewrite.prompt' has no '{{}}' subject slot: {template!r}")

    def obj_str(key: str, required: bool) -> str | None:
        v = rw.get(key)
        if v is None:
            if required:
                raise ctx.error(f"missing required field 'requested_rewrite.{key}'")
            return None
        if isinstance(v, Mapping):
            v = v.get("str")
        if not isinstance(v, str) or (required and not v.strip()):
            raise ctx.error(f"field 'requested_rewrite.{key}.str' is missing or empty")
        return v

    target_new = obj_str("target_new", True)
    target_true = obj_str("target_true", False)
    assert target_new is not None
    loc = [LocalityPrompt(p, target_true, "neighborhood") for p in _opt_strs(rec, "neighborhood_prompts", ctx)]
    loc += [LocalityPrompt(p, target_new, "attribute") for p in _opt_strs(rec, "attribute_prompts", ctx)]
    port = []
    alt = rec.get("alternative_subject")
    if isinstance(alt, str) and alt.strip():
        port.append(PortabilityPrompt(template.replace("{}", alt.strip()), target_new, "subject_aliasing"))
    return EditRequest(
        prompt=template.replace("{}", subject),
        target_new=target_new,
        subject=subject,
        ground_truth=target_true,
        rephrases=_opt_strs(rec, "paraphrase_prompts", ctx),
        locality=tuple(loc),
        portability=tuple(port),
        generation_prompts=_opt_strs(rec, "generation_prompts", ctx),
        id=ctx.rec_id,
        relation=rw.get("relation_id") or None,
        source=fmt,
    )


def _parse_easyedit(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    loc = []
    lp = rec.get("locality_prompt")
    lps = [lp] if isinstance(lp, str) else (lp or [])
    lgt = rec.get("locality_ground_truth")
    for p in lps:
        if isinstance(p, str) and p.strip():
            loc.append(LocalityPrompt(p, _answers(lgt, ctx, "locality_ground_truth"), "neighborhood"))
    return EditRequest(
        prompt=_req_str(rec, "prompt", ctx),
        target_new=_req_str(rec, "target_new", ctx),
        subject=_req_str(rec, "subject", ctx),
        ground_truth=_answers(rec.get("ground_truth"), ctx, "ground_truth"),
        rephrases=_opt_strs(rec, "rephrase_prompt", ctx),
        locality=tuple(loc),
        portability=tuple(_prompt_groups(rec.get("portability"), ctx, "portability", PortabilityPrompt)),
        id=ctx.rec_id,
        relation=rec.get("relation_id") or None,
        source=fmt,
    )
