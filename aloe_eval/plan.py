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
    """A locality prompt asked after the edit's statement (the edited fact mentioned earlier in the
    context, as in a conversation or a retrieved passage)."""
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


def plan(tokenizer, requests: Sequence[Any], start: int = 0) -> tuple[Registry, list[EditPlan]]:
    """Register every sequence the requests need; returns the registry and one plan per edit
    (indexed from ``start``: their positions in the whole stream when this is a chunk of it)."""
    reg = Registry()
    plans = []
    for i, r in enumerate(requests):
        p, c = encode_continuation(tokenizer, r.prompt, r.target_new)
        seq = reg.add(p, c)
        reph = _asked(reg, tokenizer, r.rephrases, r.target_new)
        ctx = _asked(reg, tokenizer, request_in_context(r.prompt, start + i), r.target_new)
        loc = []
        for lp in r.locality:
            gt = lp.ground_truth[0] if lp.ground_truth else None
            pids = tuple(encode_prompt(tokenizer, lp.prompt))
            if gt is not None:
                gp, gc = encode_continuation(tokenizer, lp.prompt, gt)
                k = max(1, min(len(gc), LOCALITY_MAX_TOKENS))
                tf_seq = reg.add(gp, gc)
            else:
                k, tf_seq = LOCALITY_DEFAULT_TOKENS, None
            loc.append(Locality(lp.prompt, lp.kind, gt, pids, k, tf_seq))
        distracted = []
        for lp in loc:  # compared by generation only: the same k tokens, no teacher-forced ground truth
            text = distracted_prompt(r, lp.prompt)
            distracted.append(Locality(text, lp.kind, lp.ground_truth, tuple(encode_prompt(tokenizer, text)), lp.k, None))
        port = []
        for pp in r.portability:
            if not pp.ground_truth:
                continue
            enc = [encode_continuation(tokenizer, pp.prompt, a) for a in pp.ground_truth]
            seq_p = reg.add(*enc[0])
            port.append(Portability(pp.prompt, pp.kind, tuple(pp.ground_truth), seq_p, tuple(e[1] for e in enc)))
        plans.append(EditPlan(start + i, r, seq, reph, loc, port, distracted, ctx))
    return reg, plans
