"""The unique token sequences an evaluation scores, and which edit each belongs to.

Every (prompt, continuation) pair is registered once and scored once per
editor, whatever number of edits, rephrases or locality prompts share it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

from aloe_build.data import fact_statement
from aloe_build.tokens import encode_continuation, encode_prompt

from .definitions import LOCALITY_DEFAULT_TOKENS, LOCALITY_MAX_TOKENS
from .in_context import request_in_context


@dataclasses.dataclass
class Rephrase:
    prompt: str
    seq: int


@dataclasses.dataclass
class Locality:
    prompt: str
    kind: str
    ground_truth: str | None
    prompt_ids: tuple[int, ...]
    k: int
    tf_seq: int | None  # EasyEdit: prompt + " " + ground_truth[0]
    gen_seq: int | None = None  # prompt + unedited greedy continuation (set after the reference pass)


@dataclasses.dataclass
class Portability:
    prompt: str
    kind: str
    answers: tuple[str, ...]
    seq: int  # prompt + " " + answers[0]
    answer_ids: tuple[tuple[int, ...], ...]  # continuation ids of each answer


@dataclasses.dataclass
class EditPlan:
    index: int
    request: Any
    seq: int
    rephrases: list[Rephrase]
    locality: list[Locality]
    portability: list[Portability]
    distracted: list[Locality] = dataclasses.field(default_factory=list)  # locality after the edit's statement
    in_context: list[Rephrase] = dataclasses.field(default_factory=list)  # the request after unrelated text


def statement(request: Any) -> str:
    """The edit's new fact as a sentence (:func:`aloe_build.data.fact_statement`)."""
    return fact_statement(request.prompt, request.target_new)


def distracted_prompt(request: Any, question: str) -> str:
    """A prompt asked after the edit's statement (the edited fact mentioned earlier in the context,
    as in a conversation or a retrieved passage): a locality prompt for distracted locality, any
    prompt of the edit for the told control (:func:`told_plan`)."""
    return f"{statement(request)} {question}"


class Registry:
    """Unique (prompt_ids, continuation_ids) sequences: each is scored once per editor."""

    def __init__(self) -> None:
        self.seqs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.want_hidden: list[bool] = []
        self._index: dict[tuple, int] = {}

    def add(self, prompt_ids: tuple[int, ...], cont: tuple[int, ...], hidden: bool = False) -> int:
        key = (prompt_ids, cont)
        j = self._index.get(key)
        if j is None:
            j = self._index[key] = len(self.seqs)
            self.seqs.append(key)
            self.want_hidden.append(hidden)
        elif hidden:
            self.want_hidden[j] = True
        return j


def _asked(reg: Registry, tokenizer, prompts: Sequence[str], target: str) -> list[Rephrase]:
    """Other prompts asking for the edit's target (rewordings, the request in context), registered."""
    return [Rephrase(text, reg.add(*encode_continuation(tokenizer, text, target))) for text in prompts]


def _locality(reg: Registry, tokenizer, lp: Any) -> Locality:
    """A locality prompt of the data, its teacher-forced ground truth registered (EasyEdit's)."""
    gt = lp.ground_truth[0] if lp.ground_truth else None
    pids = tuple(encode_prompt(tokenizer, lp.prompt))
    if gt is None:
        return Locality(lp.prompt, lp.kind, gt, pids, LOCALITY_DEFAULT_TOKENS, None)
    gp, gc = encode_continuation(tokenizer, lp.prompt, gt)
    k = max(1, min(len(gc), LOCALITY_MAX_TOKENS))
    return Locality(lp.prompt, lp.kind, gt, pids, k, reg.add(gp, gc))


def _portability(reg: Registry, tokenizer, prompt: str, kind: str, answers: Sequence[str]) -> Portability:
    """A portability prompt with its accepted answers, the first one's sequence registered."""
    enc = [encode_continuation(tokenizer, prompt, a) for a in answers]
    return Portability(prompt, kind, tuple(answers), reg.add(*enc[0]), tuple(e[1] for e in enc))


def plan(tokenizer, requests: Sequence[Any], start: int = 0) -> tuple[Registry, list[EditPlan]]:
    """Register every sequence the requests need; returns the registry and one plan per edit
    (indexed from ``start``: their positions in the whole stream when this is a chunk of it)."""
    reg = Registry()
    plans = []
    for i, r in enumerate(requests):
        seq = reg.add(*encode_continuation(tokenizer, r.prompt, r.target_new))
        reph = _asked(reg, tokenizer, r.rephrases, r.target_new)
        ctx = _asked(reg, tokenizer, request_in_context(r.prompt, start + i), r.target_new)
        loc = [_locality(reg, tokenizer, lp) for lp in r.locality]
        distracted = []
        for lp in loc:  # compared by generation only: the same k tokens, no teacher-forced ground truth
            text = distracted_prompt(r, lp.prompt)
            distracted.append(Locality(text, lp.kind, lp.ground_truth, tuple(encode_prompt(tokenizer, text)), lp.k, None))
        port = [_portability(reg, tokenizer, pp.prompt, pp.kind, pp.ground_truth) for pp in r.portability if pp.ground_truth]
        plans.append(EditPlan(start + i, r, seq, reph, loc, port, distracted, ctx))
    return reg, plans


def told_plan(tokenizer, reg: Registry, plans: Sequence[EditPlan]) -> tuple[Registry, list[EditPlan], dict[int, int]]:
    """The in-context control of ``plans``: every prompt of an edit asked after the edit's statement
    (:func:`distracted_prompt`: "<statement> <request>", "<statement> <rephrase>", "<statement>
    <unrelated sentence> <request>", "<statement> <portability prompt>", "<statement> <locality
    prompt>"), in a registry of its own. Needs the plain plans' reference continuations
    (``Locality.gen_seq``, set by :func:`aloe_eval.scoring.build_reference`).

    Returns the registry, one plan per edit (no distracted prompts: every locality prompt already
    follows the statement) and, for each told locality sequence, the plain sequence it stands for:
    the told prompt continues with the plain prompt's unedited answer (and ground truth), so that
    locality counts what telling the fact changes in the answer to the plain question."""
    told = Registry()
    plain_of: dict[int, int] = {}
    out = []
    for p in plans:
        r = p.request
        seq = told.add(*encode_continuation(tokenizer, distracted_prompt(r, r.prompt), r.target_new))
        reph = _asked(told, tokenizer, [distracted_prompt(r, x.prompt) for x in p.rephrases], r.target_new)
        ctx = _asked(told, tokenizer, [distracted_prompt(r, x.prompt) for x in p.in_context], r.target_new)
        loc = [_told_locality(told, tokenizer, reg, r, lp, plain_of) for lp in p.locality]
        port = [_portability(told, tokenizer, distracted_prompt(r, pp.prompt), pp.kind, pp.answers) for pp in p.portability]
        out.append(EditPlan(p.index, r, seq, reph, loc, port, [], ctx))
    return told, out, plain_of


def _told_locality(told: Registry, tokenizer, reg: Registry, request: Any, lp: Locality, plain_of: dict[int, int]) -> Locality:
    """Locality prompt ``lp`` (of ``reg``) after the statement of ``request``, registered in ``told`` with
    the plain prompt's continuations; ``plain_of`` records which plain sequence each one stands for."""
    if lp.gen_seq is None:
        raise ValueError("the told plan needs the plain plan's locality references: run build_reference first")
    text = distracted_prompt(request, lp.prompt)
    ids = tuple(encode_prompt(tokenizer, text))
    gen = told.add(ids, reg.seqs[lp.gen_seq][1], hidden=True)
    plain_of[gen] = lp.gen_seq
    tf = None
    if lp.tf_seq is not None:
        tf = told.add(ids, reg.seqs[lp.tf_seq][1])
        plain_of[tf] = lp.tf_seq
    return Locality(text, lp.kind, lp.ground_truth, ids, lp.k, tf, gen)
