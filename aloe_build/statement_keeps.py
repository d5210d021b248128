"""Answers that must not change after an edit's own statement (stage 8's keep sequences).

An edit fires wherever its request is read, also inside a sentence that states the new fact
("Spike Hughes originates from Philadelphia."). The write added there is read by attention at
every later position, so without care a question asked after the statement gets another answer
than the unedited model gives: on 100 zsRE edits, 25 of 26 such changes came from the gates inside
the statement and 1 from gates after it (docs/experiments.md, "Why answers change after the edited
fact is stated"). With ``finetune_keep_after_statement`` stage 8 also trains the writes to keep the
unedited model's answers to a few questions asked after each edit's statement, plainly and, with
chat positives, as a second user turn: an experiment, off by default (it lowered the leak to the
target but changed more answers).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Sequence

from .chunked import continued
from .config import BuildConfig
from .corpus import Corpus
from .data import fact_statement
from .questions import generic_questions
from .slots import Slot
from .tokens import chat_prompt, common_prefix_length, encode_prompt

#: Generic questions, and corpus requests, that the keep questions are drawn from (each).
KEEP_POOL = 200


@dataclass
class KeepSequences:
    """Token sequences (prompt + the unedited answer), how many final tokens are the answer, and
    the slot whose statement each follows."""

    seqs: list[list[int]]
    answer_lens: list[int]
    owners: list[int]


def keep_questions(corpus: Corpus, slot: Slot, k: int, seed: int) -> list[str]:
    """``k`` questions for one slot: generic questions and corpus requests about other subjects,
    drawn by the slot's request alone (an append draws the same for the same edit)."""
    pool = generic_questions(corpus.subjects, KEEP_POOL) + [it.request for it in corpus.items[:KEEP_POOL]]
    if slot.subject:
        pool = [q for q in pool if slot.subject not in q]
    return random.Random(f"{seed}\x00keep\x00{slot.prompt}").sample(pool, min(k, len(pool)))


def after_statement(tokenizer, slot: Slot, question: str, chat: bool) -> tuple[list[int], int]:
    """``question`` asked after the slot's statement, plainly ('<request> <target>. <question>') or
    as the second of two user turns: its token ids, and the first position past the statement."""
    return after_text(tokenizer, fact_statement(slot.prompt, slot.target), question, chat)


def after_text(tokenizer, said: str, question: str, chat: bool) -> tuple[list[int], int]:
    """``question`` asked after the sentence ``said``, plainly ('<said> <question>') or as the second
    of two user turns: its token ids, and the first position past ``said``."""
    if chat:
        ids = chat_prompt(tokenizer, [said, question])
        return ids, common_prefix_length(ids, chat_prompt(tokenizer, said))
    ids = encode_prompt(tokenizer, f"{said} {question}")
    return ids, common_prefix_length(ids, encode_prompt(tokenizer, said))


def statement_keeps(model, tokenizer, slots: Sequence[Slot], corpus: Corpus, layer: int, cfg: BuildConfig) -> KeepSequences:
    """Each slot's statement followed by ``cfg.experimental.finetune_keep_after_statement`` questions, with the
    answer the model gives now (``cfg.negative_continuation_tokens`` at most, cut at a stop token):
    plainly, and with chat positives also as two user turns. Questions answered by an immediate stop
    are left out (nothing to keep)."""
    k = cfg.experimental.finetune_keep_after_statement
    prompts: list[list[int]] = []
    owners: list[int] = []
    for i, s in enumerate(slots if k > 0 else []):
        for q in keep_questions(corpus, s, k, cfg.seed):
            for chat in (False, True) if cfg.chat.positives_chat else (False,):
                prompts.append(after_statement(tokenizer, s, q, chat)[0])
                owners.append(i)
    if not prompts:
        return KeepSequences([], [], [])
    full, _ = continued(
        model, tokenizer, prompts, cfg.negative_continuation_tokens, layer, cfg.batch_size, "stage 8: answers after statements"
    )
    out = KeepSequences([], [], [])
    for p, f, o in zip(prompts, full, owners):
        if len(f) > len(p):
            out.seqs.append(list(f))
            out.answer_lens.append(len(f) - len(p))
            out.owners.append(o)
    return out
