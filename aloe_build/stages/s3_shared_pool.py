"""Stage 3's shared negative pool: corpus prompts, generic questions and (with chat positives) their
chat forms and system headers, at every position, with the unedited model's continuations. It is the
same for every edit of a model, layer and corpus, so it is cached there and built once.
"""

from __future__ import annotations

import hashlib
import random
from pathlib import Path

import torch

from ..checkpoints import cached_tensor
from ..chunked import continued
from ..config import BuildConfig
from ..corpus import Corpus
from ..questions import QUESTIONS_VERSION, generic_questions
from ..statement_keeps import after_text
from ..system_prompts import GENERIC_SYSTEM_PROMPTS
from ..tokens import (
    chat_header_length,
    chat_prompt,
    chat_template_key,
    encode_prompt,
)


def shared_negative_texts(corpus: Corpus, cfg: BuildConfig) -> list[str]:
    """The corpus prompts whose states, and those of their continuations, are the shared pool."""
    texts: list[str] = []
    for it in corpus.items[: cfg.negative_pool_records]:
        texts += [it.request, it.locality, *it.same_subject[:1]]
    return list(dict.fromkeys(texts))


def shared_paraphrase_texts(corpus: Corpus, cfg: BuildConfig, edited_subjects: frozenset[str]) -> list[str]:
    """Other wordings of the first ``negatives_paraphrases`` corpus requests ("X is incredible at"),
    except those about an edited subject (a rewording of an edit's own fact is not its negative)."""
    return list(
        dict.fromkeys(
            it.paraphrase for it in corpus.items[: cfg.experimental.negatives_paraphrases] if it.subject not in edited_subjects
        )
    )


def shared_question_texts(corpus: Corpus, cfg: BuildConfig) -> list[str]:
    """The generic questions of the shared pool, about corpus subjects (see :mod:`.questions`)."""
    return generic_questions(corpus.subjects, cfg.negatives_questions)


def pool_prompt_prefixes(tokenizer, corpus: Corpus, cfg: BuildConfig) -> set[tuple[int, ...]]:
    """Every token prefix of the shared pool's prompts: their states are negatives of every slot."""
    return {
        tuple(ids[: t + 1])
        for text in shared_negative_texts(corpus, cfg) + shared_question_texts(corpus, cfg)
        for ids in [encode_prompt(tokenizer, text)]
        for t in range(len(ids))
    }


def shared_negatives(
    model, tokenizer, layer: int, path: Path, corpus: Corpus, cfg: BuildConfig, edited_subjects: frozenset[str] = frozenset()
) -> torch.Tensor:
    """States at every position of corpus prompts (requests, locality inputs, same-subject prompts,
    with ``negatives_paraphrases`` their rewordings) and generic questions, and of their greedy
    continuations: negatives for every edit. They depend only on the model, layer and corpus items
    (the rewordings also on which subjects are edited), so they are cached (see
    pipeline.negatives_cache_dir) and shared by every build. With chat positives, the chat-form pool
    (:func:`shared_chat_negatives`) is added."""

    def continued_states(texts: list[str], desc: str) -> torch.Tensor:
        prompts = [encode_prompt(tokenizer, t) for t in texts]
        return continued(
            model, tokenizer, prompts, cfg.negative_continuation_tokens, layer, cfg.batch_size, desc, starts=[0] * len(prompts)
        )[1].states

    tokens = cfg.negative_continuation_tokens
    pool = cached_tensor(
        path / f"negatives-{cfg.negative_pool_records}-c{tokens}.safetensors",
        lambda: continued_states(shared_negative_texts(corpus, cfg), "stage 3: shared negatives and their continuations"),
    )
    if cfg.experimental.negatives_paraphrases > 0:
        texts = shared_paraphrase_texts(corpus, cfg, edited_subjects)
        digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:12]
        reworded = cached_tensor(
            path / f"negatives-paraphrases-{digest}-c{tokens}.safetensors",
            lambda: continued_states(texts, "stage 3: corpus rewordings and their continuations"),
        )
        pool = torch.cat([pool, reworded])
    if cfg.negatives_questions > 0:
        name = f"negatives-questions-{cfg.negatives_questions}-c{tokens}-v{QUESTIONS_VERSION}.safetensors"
        pool = torch.cat(
            [
                pool,
                cached_tensor(
                    path / name,
                    lambda: continued_states(
                        shared_question_texts(corpus, cfg), "stage 3: generic questions and their continuations"
                    ),
                ),
            ]
        )
    if cfg.chat.positives_chat and cfg.chat.negatives_chat_pool > 0:
        pool = torch.cat([pool, shared_chat_negatives(model, tokenizer, layer, path, corpus, cfg)])
    if cfg.negatives_distracting > 0:
        pool = torch.cat([pool, distracting_negatives(model, tokenizer, layer, path, corpus, cfg)])
    return pool


def distracting_negatives(model, tokenizer, layer: int, path: Path, corpus: Corpus, cfg: BuildConfig) -> torch.Tensor:
    """Corpus statements each followed by a same-relation request about another subject
    (:meth:`Corpus.distracting_pairs`), plainly and, with chat positives, as a second user turn, with
    the unedited model's continuations: states from the first position past the statement. A gate
    that opens there is one the statement before the question opened."""
    pairs = corpus.distracting_pairs(cfg.negatives_distracting, random.Random(f"{cfg.seed}\x00distracting"))
    forms = (False, True) if cfg.chat.positives_chat else (False,)

    def compute() -> torch.Tensor:
        asked = [after_text(tokenizer, said, question, chat) for said, question in pairs for chat in forms]
        return continued(
            model,
            tokenizer,
            [ids for ids, _ in asked],
            cfg.negative_continuation_tokens,
            layer,
            cfg.batch_size,
            "stage 3: questions after statements and their continuations",
            starts=[head for _, head in asked],
        )[1].states

    chat = f"-{chat_template_key(tokenizer, ())}" if cfg.chat.positives_chat else ""
    name = f"negatives-distracting-{len(pairs)}-s{cfg.seed}-c{cfg.negative_continuation_tokens}{chat}"
    return cached_tensor(path / f"{name}.safetensors", compute)


#: How many of the chat pool's questions are asked again after each generic system prompt.
QUESTIONS_PER_GENERIC_SYSTEM = 4


def shared_chat_negatives(model, tokenizer, layer: int, path: Path, corpus: Corpus, cfg: BuildConfig) -> torch.Tensor:
    """The requests and locality prompts of the first ``negatives_chat_pool`` corpus records asked
    through the chat template, then ``negatives_chat_questions`` generic questions, with the
    unedited model's answers: states at every position after the template's shared header (that
    header once per system prompt): where a chat-form anchor's neighbours lie. A few of the corpus
    texts are asked again after each of the first ``negatives_chat_systems`` generic system
    prompts, whose headers hold the tokens that close a system turn."""
    systems = (None, *cfg.chat.chat_systems)
    generic = GENERIC_SYSTEM_PROMPTS[: cfg.chat.negatives_chat_systems]

    def compute() -> torch.Tensor:
        texts = list(dict.fromkeys(t for it in corpus.items[: cfg.chat.negatives_chat_pool] for t in (it.request, it.locality)))
        texts = list(dict.fromkeys(texts + generic_questions(corpus.subjects, cfg.chat.negatives_chat_questions)))
        asked_after = [systems[k % len(systems)] for k in range(len(texts))]
        again = [texts[k % len(texts)] for k in range(len(generic) * QUESTIONS_PER_GENERIC_SYSTEM)] if texts else []
        texts += again
        asked_after += [generic[k // QUESTIONS_PER_GENERIC_SYSTEM] for k in range(len(again))]
        heads = {s: chat_header_length(tokenizer, s) for s in (*systems, *generic)}
        # each system prompt's header once (its first sequence whole), the rest after the header
        first = {s: asked_after.index(s) for s in heads if s in asked_after}
        starts = [0 if first[s] == k else heads[s] for k, s in enumerate(asked_after)]
        prompts = [chat_prompt(tokenizer, t, s) for t, s in zip(texts, asked_after)]
        return continued(
            model,
            tokenizer,
            prompts,
            cfg.chat.negatives_chat_answer_tokens,
            layer,
            cfg.batch_size,
            "stage 3: chat negatives and their answers",
            starts=starts,
        )[1].states

    questions = f"-q{cfg.chat.negatives_chat_questions}v{QUESTIONS_VERSION}" if cfg.chat.negatives_chat_questions > 0 else ""
    name = (
        f"negatives-chat-{cfg.chat.negatives_chat_pool}-c{cfg.chat.negatives_chat_answer_tokens}-s{len(generic)}{questions}-"
        f"{chat_template_key(tokenizer, (*cfg.chat.chat_systems, *generic))}"
    )
    return cached_tensor(path / f"{name}.safetensors", compute)
