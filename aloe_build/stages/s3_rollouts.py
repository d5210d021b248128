"""Stage 3, rollouts: the anchor states of each slot and the negatives it must stay shut on.

Anchors are states along the teacher-forced target (the states the edited
model passes through while it generates the target) and at the last token of
the request after corpus statements. Negatives are corpus prompts and generic
questions at every position and their greedy continuations (shared by every edit, cached per
model, layer and corpus), the unedited model's continuations of every request, and
prompts made for each edit: the request's earlier positions, same-subject
other-relation prompts, same-relation other-subject prompts, the stream's
other templates and subjects, word-swapped templates and exclusion rewordings.
With chat positives, corpus prompts, generic questions and each edit's first own
negatives are also asked through the chat template.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from aloe_kernels.hf import locate_down_proj

from ..checkpoints import PartStore, save_tensors_atomically
from ..chunked import chunked_states, chunked_tokens_and_states
from ..config import BuildConfig
from ..corpus import Corpus, exclusion_prompts, relation_words, word_swapped_templates
from ..forward import Tick, generate_with_states, in_precision, teacher_forced
from ..questions import QUESTIONS_VERSION, generic_questions
from ..slots import Slot
from ..states import StateBatch
from ..system_prompts import GENERIC_SYSTEM_PROMPTS
from ..tokens import (
    chat_answer,
    chat_header_length,
    chat_prompt,
    chat_template_key,
    encode_continuation,
    encode_prompt,
    end_index,
    pad_id,
    stop_ids,
)


@dataclass
class TokenSequences:
    """The token sequences of a build: each slot's request and target, then the extra positives:
    those with anchors along a target first (rewordings, soft anchors; the chat form), then the
    request after corpus statements (anchored at its last prompt token)."""

    prompts: list[list[int]]
    targets: list[list[int]]
    extra_prompts: list[list[int]]
    extra_owner: list[int]
    extra_soft: list[bool]
    extra_targets: list[list[int]] = field(default_factory=list)  # the target each extra continues with
    extra_along: list[bool] = field(default_factory=list)  # anchored along its target (else last prompt token)
    extra_chat: list[bool] = field(default_factory=list)  # the request asked through the chat template

    def add(
        self, prompt: list[int], owner: int, soft: bool, along: bool, target: list[int] | None = None, chat: bool = False
    ) -> None:
        if along and self.extra_along and not self.extra_along[-1]:
            raise ValueError("extras anchored along a target must come before those anchored at the prompt")
        self.extra_chat.append(chat)
        self.extra_prompts.append(prompt)
        self.extra_owner.append(owner)
        self.extra_soft.append(soft)
        self.extra_targets.append(self.targets[owner] if target is None else target)
        self.extra_along.append(along)

    def target(self, seq: int) -> list[int]:
        """The target of anchor sequence ``seq`` (a request for ``seq`` < slots, else an extra)."""
        n = len(self.prompts)
        return self.targets[seq] if seq < n else self.extra_targets[seq - n]

    @property
    def along(self) -> int:
        """How many extras (the first ones) are anchored along their target."""
        return sum(self.extra_along)

    @property
    def trained(self) -> list[int]:
        """Extra sequences that always train the writes: the required ones along a target."""
        n = len(self.prompts)
        return [n + k for k, (a, soft) in enumerate(zip(self.extra_along, self.extra_soft)) if a and not soft]

    @property
    def seq_owner(self) -> torch.Tensor:
        """The slot of every anchor sequence: the requests (sequence i = slot i), then the extras."""
        return torch.tensor(list(range(len(self.prompts))) + self.extra_owner, dtype=torch.long)

    @property
    def seq_soft(self) -> torch.Tensor:
        return torch.tensor([False] * len(self.prompts) + self.extra_soft, dtype=torch.bool)

    @property
    def seq_chat(self) -> torch.Tensor:
        """Whether each anchor sequence is a chat form (a request asked through the chat template)."""
        return torch.tensor([False] * len(self.prompts) + self.extra_chat, dtype=torch.bool)


def token_sequences(tokenizer, slots: Sequence[Slot], corpus: Corpus, cfg: BuildConfig) -> TokenSequences:
    """Requests, targets and the extra positives of every slot (each kind from its own generator,
    so that one does not change when another is switched on)."""
    prompts, targets = [], []
    for s in slots:
        p, t = encode_continuation(tokenizer, s.prompt, s.target)
        prompts.append(list(p))
        targets.append(list(t))
    seqs = TokenSequences(prompts, targets, [], [], [])
    # Paraphrase positives from construction data: other templates of each request's relation,
    # filled with its subject, followed by its target. Their anchors are soft (wished for, see
    # addresses.refine_addresses): the address cannot separate every rewording from the negatives.
    para_rng = random.Random(cfg.seed + 1)
    for i, s in enumerate(slots):
        if s.template and cfg.experimental.positives_same_relation > 0:
            for text in corpus.same_relation_prompts(s.template, s.subject, cfg.experimental.positives_same_relation, para_rng):
                seqs.add(encode_prompt(tokenizer, text), i, soft=True, along=True)
    # The request as a chat model is asked: the answer starts with the target (no leading space).
    for i, ids in chat_forms(tokenizer, slots, cfg):
        seqs.add(ids, i, soft=False, along=True, target=chat_answer(tokenizer, slots[i].target), chat=True)
    # The request after corpus statements: the edit must fire whatever text comes before it, so
    # these anchors are required like the request's own.
    prefix_rng = random.Random(cfg.seed + 3)
    statements = corpus.statement_pool(cfg.experimental.positives_prefix_pool, prefix_rng) if cfg.positives_prefixed > 0 else []
    for i, s in enumerate(slots):
        for text in corpus.prefixed_prompts(s.prompt, cfg.positives_prefixed, prefix_rng, statements):
            seqs.add(encode_prompt(tokenizer, text), i, soft=False, along=False)
    return seqs


def chat_forms(tokenizer, slots: Sequence[Slot], cfg: BuildConfig) -> list[tuple[int, list[int]]]:
    """(slot, token ids) of each request asked through the chat template, after the template's
    default system prompt and then after each of ``cfg.chat.chat_systems``; none without chat positives."""
    if not cfg.chat.positives_chat:
        return []
    return [
        (i, chat_prompt(tokenizer, s.prompt, system)) for system in (None, *cfg.chat.chat_systems) for i, s in enumerate(slots)
    ]


#: Generation batches hold this many times ``batch_size`` prompts: a greedy step costs little more
#: for more rows, as its time goes to per-step overhead (docs/results.md, "Continuations").
GENERATION_BATCH_MULTIPLE = 4


def continued(
    model,
    tokenizer,
    prompts: list[list[int]],
    tokens: int,
    layer: int,
    batch_size: int,
    desc: str,
    parts: PartStore | None = None,
    name: str = "continuations",
    starts: Sequence[int] | None = None,
) -> tuple[list[list[int]], StateBatch]:
    """Each prompt followed by the unedited model's greedy continuation of up to ``tokens`` tokens,
    cut before its first stop token (EOS or end of turn, :func:`~aloe_build.tokens.stop_ids`: a
    server stops there and never feeds it back), and the
    normalized states of each continued sequence from position ``starts[i]`` (default: its first
    continuation token) to its end, taken while generating (:func:`generate_with_states`), in
    batches of ``batch_size * GENERATION_BATCH_MULTIPLE`` prompts."""
    stops = stop_ids(tokenizer)

    def generate(lo: int, hi: int, tick: Tick) -> tuple[list[list[int]], list[torch.Tensor]]:
        gens, states = generate_with_states(
            model,
            prompts[lo:hi],
            max(tokens, 0),
            layer,
            starts=None if starts is None else starts[lo:hi],
            pad_id=pad_id(tokenizer),
            batch_size=batch_size * GENERATION_BATCH_MULTIPLE,
            tick=tick,
        )
        kept = [g[: end_index(g, stops)] for g in gens]
        return kept, [st[: len(st) - (len(g) - len(k))] for st, g, k in zip(states, gens, kept)]

    gens, got = chunked_tokens_and_states(
        parts, f"{name}-with-states", len(prompts), generate, desc, locate_down_proj(model, layer).d
    )
    return [list(p) + g for p, g in zip(prompts, gens)], got


def along_target_anchors(
    model,
    tokenizer,
    prompts: list[list[int]],
    targets: list[list[int]],
    layer: int,
    cap: int,
    keep_predicted: bool,
    batch_size: int,
    parts: PartStore | None = None,
) -> tuple[list[list[int]], StateBatch]:
    """Anchor positions along each target, and their states: the last prompt token (it predicts the
    first target token), then each position predicting a further target token within ``cap``.
    Unless ``keep_predicted``, a further position is left out when the unedited model already
    predicts its target token from the request and the target so far: it needs no write, and its
    state is the target text's own ("Knight's Cross" after "Knight"), which the target in any other
    context shares. The states are taken in the pass that finds the predicted tokens."""
    spans = [list(range(len(p) - 1, len(p) - 1 + min(len(t), cap))) for p, t in zip(prompts, targets)]
    if keep_predicted or not prompts:
        return spans, chunked_states(
            parts, "anchors", model, tokenizer, [p + t for p, t in zip(prompts, targets)], layer, spans, "stage 3: anchor states"
        )

    def predicted(lo: int, hi: int, tick: Tick) -> tuple[list[list[int]], list[torch.Tensor]]:
        res = teacher_forced(
            model,
            [(p, t[:cap]) for p, t in zip(prompts[lo:hi], targets[lo:hi])],
            pad_id=pad_id(tokenizer),
            batch_size=batch_size,
            states_layer=layer,
            tick=tick,
        )
        kept = [[k for k, pr in enumerate(r.preds) if k == 0 or pr != t[k]] for r, t in zip(res, targets[lo:hi])]
        return kept, [r.states[k] for r, k in zip(res, kept)]

    kept, states = chunked_tokens_and_states(
        parts,
        "predicted-with-states",
        len(prompts),
        predicted,
        "stage 3: target tokens already predicted, and anchor states",
        locate_down_proj(model, layer).d,
    )
    return [[span[k] for k in ks] for span, ks in zip(spans, kept)], states


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


def _cached_states(file: Path, compute) -> torch.Tensor:
    """States read from ``file``, or computed by ``compute()`` and written there atomically."""
    from safetensors.torch import load_file

    if file.is_file():
        return load_file(str(file))["states"]
    states = compute()
    file.parent.mkdir(parents=True, exist_ok=True)
    save_tensors_atomically({"states": states.contiguous()}, file)
    return states


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
    pool = _cached_states(
        path / f"negatives-{cfg.negative_pool_records}-c{tokens}.safetensors",
        lambda: continued_states(shared_negative_texts(corpus, cfg), "stage 3: shared negatives and their continuations"),
    )
    if cfg.experimental.negatives_paraphrases > 0:
        texts = shared_paraphrase_texts(corpus, cfg, edited_subjects)
        digest = hashlib.sha256("\n".join(texts).encode()).hexdigest()[:12]
        reworded = _cached_states(
            path / f"negatives-paraphrases-{digest}-c{tokens}.safetensors",
            lambda: continued_states(texts, "stage 3: corpus rewordings and their continuations"),
        )
        pool = torch.cat([pool, reworded])
    if cfg.negatives_questions > 0:
        name = f"negatives-questions-{cfg.negatives_questions}-c{tokens}-v{QUESTIONS_VERSION}.safetensors"
        pool = torch.cat(
            [
                pool,
                _cached_states(
                    path / name,
                    lambda: continued_states(
                        shared_question_texts(corpus, cfg), "stage 3: generic questions and their continuations"
                    ),
                ),
            ]
        )
    if cfg.chat.positives_chat and cfg.chat.negatives_chat_pool > 0:
        pool = torch.cat([pool, shared_chat_negatives(model, tokenizer, layer, path, corpus, cfg)])
    return pool


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
    return _cached_states(path / f"{name}.safetensors", compute)


def not_anchors(states: torch.Tensor, anchors: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Which states are not (numerically) an anchor: a corpus prompt identical to an edit's
    request must not become that edit's negative."""
    keep = torch.ones(states.shape[0], dtype=torch.bool)
    for start in range(0, states.shape[0], chunk):
        sim = states[start : start + chunk] @ anchors.T
        keep[start : start + chunk] = sim.max(1).values < 0.9999 if anchors.shape[0] else True
    return keep


class _Stream:
    """What the edited stream offers as negatives of each edit: its templates, their relations,
    its subjects, and the relation words that can be swapped."""

    def __init__(self, slots: Sequence[Slot], corpus: Corpus, seed: int):
        self.rng = random.Random(seed + 2)
        self.relation_of = {s.template: s.relation for s in slots if s.template}
        self.templates = list(self.relation_of)
        self.subjects = list(dict.fromkeys(s.subject for s in slots if s.subject))
        self.swap_words = relation_words(self.templates + list(corpus.group_of_template))


def _edit_negative_texts(s: Slot, corpus: Corpus, stream: _Stream, cfg: BuildConfig, rng: random.Random) -> list[list[str]]:
    """The prompts made for one edit whose states (every position) are negatives of its slot, one
    list per kind: other relations of its subject, its template with other corpus subjects, the
    stream's other templates with its subject, its template with other stream subjects, word swaps,
    exclusion rewordings."""
    template = s.template
    group = corpus.group_of_template.get(template or "", s.relation or template or "")
    kinds = [corpus.other_relation_prompts(s.subject, group, cfg.negatives_same_subject, rng) if s.subject else []]
    kinds.append(corpus.other_subject_prompts(template, s.subject, cfg.negatives_same_relation, rng) if template else [])
    picked: list[str] = []
    if s.subject and cfg.negatives_stream_templates > 0:
        others = [t for t in stream.templates if t != template and not (s.relation and stream.relation_of[t] == s.relation)]
        picked = [t.replace("{}", s.subject) for t in stream.rng.sample(others, min(cfg.negatives_stream_templates, len(others)))]
    kinds.append(picked)
    other_subjects = [x for x in stream.subjects if x != s.subject]
    picked = []
    if template and cfg.negatives_stream_subjects > 0:
        picked = [
            template.replace("{}", x)
            for x in stream.rng.sample(other_subjects, min(cfg.negatives_stream_subjects, len(other_subjects)))
        ]
    kinds.append(picked)
    picked = []
    if template and cfg.negatives_word_swaps > 0:
        swapped = word_swapped_templates(template, stream.swap_words, cfg.negatives_word_swaps, stream.rng)
        picked = [
            t.replace("{}", s.subject if j % 2 == 0 or not other_subjects else stream.rng.choice(other_subjects))
            for j, t in enumerate(swapped)
        ]
    kinds.append(picked)
    kinds.append(exclusion_prompts(s.prompt, s.target, cfg.negatives_exclusions))
    return kinds


def in_turn(kinds: Sequence[Sequence[str]], n: int) -> list[str]:
    """The first ``n`` texts taken one of each kind in turn (the first of every kind, then the
    second, ...), skipping kinds that have run out."""
    out: list[str] = []
    for rank in range(max((len(k) for k in kinds), default=0)):
        out += [k[rank] for k in kinds if rank < len(k)]
    return out[:n]


def edit_negative_sequences(
    tokenizer, slots: Sequence[Slot], seqs: TokenSequences, corpus: Corpus, cfg: BuildConfig, rng: random.Random
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """The token sequences made for each edit, the positions of each whose states are negatives,
    and the slot each belongs to.

    The state at a position depends only on the tokens up to it, so a position whose token prefix
    the same slot already has is left out: its state would be a duplicate negative of that slot
    (about 30% of the positions on CounterFact: the slot's prompts share their subject's opening).
    So is one whose prefix opens a prompt of the shared pool, already a negative of every slot."""
    stream = _Stream(slots, corpus, cfg.seed)
    chat_head = chat_header_length(tokenizer) if cfg.chat.positives_chat and cfg.chat.negatives_chat_own > 0 else 0
    in_pool = pool_prompt_prefixes(tokenizer, corpus, cfg)
    spec_seqs, spec_pos, spec_owner = [], [], []
    for i, s in enumerate(slots):
        seen: set[tuple[int, ...]] = set()

        def add(ids: list[int], positions: range) -> None:
            fresh = []
            for t in positions:
                key = tuple(ids[: t + 1])
                if key not in seen and key not in in_pool:
                    seen.add(key)
                    fresh.append(t)
            if fresh:
                spec_seqs.append(ids)
                spec_pos.append(fresh)
                spec_owner.append(i)

        add(seqs.prompts[i], range(len(seqs.prompts[i]) - 1))  # earlier positions of the request itself
        kinds = _edit_negative_texts(s, corpus, stream, cfg, rng)
        for t in (t for k in kinds for t in k):
            ids = encode_prompt(tokenizer, t)
            add(ids, range(len(ids)))
        for t in in_turn(kinds, cfg.chat.negatives_chat_own) if cfg.chat.positives_chat else []:
            ids = chat_prompt(tokenizer, t)  # the template's header is in the shared chat pool
            add(ids, range(chat_head, len(ids)))
    return spec_seqs, spec_pos, spec_owner


def edit_negatives(
    model,
    tokenizer,
    slots: Sequence[Slot],
    seqs: TokenSequences,
    corpus: Corpus,
    layer: int,
    cfg: BuildConfig,
    rng: random.Random,
    parts: PartStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """States of the prompts made for each edit and the slot each belongs to."""
    spec_seqs, spec_pos, spec_owner = edit_negative_sequences(tokenizer, slots, seqs, corpus, cfg, rng)
    spec = chunked_states(parts, "edit_negatives", model, tokenizer, spec_seqs, layer, spec_pos, "stage 3: edit negatives")
    owner = torch.repeat_interleave(torch.tensor(spec_owner, dtype=torch.long), spec.offsets[1:] - spec.offsets[:-1])
    return spec.states, owner


def answer_states(
    model,
    tokenizer,
    prompts: list[list[int]],
    owner: list[int],
    layer: int,
    tokens: int,
    batch_size: int,
    parts: PartStore | None,
    name: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """States along the unedited model's greedy continuation (up to ``tokens``) of each prompt, and
    the slot each continuation belongs to (``owner`` of its prompt); ``name`` keys the saved chunks."""
    _, got = continued(
        model, tokenizer, prompts, tokens, layer, batch_size, f"stage 3: {name} of requests and their states", parts, name
    )
    return got.states, torch.tensor(owner, dtype=torch.long)[got.owner()]


def rollouts(
    model,
    tokenizer,
    slots: Sequence[Slot],
    seqs: TokenSequences,
    corpus: Corpus,
    cache_dir: Path,
    layer: int,
    cfg: BuildConfig,
    rng: random.Random,
    parts: PartStore | None = None,
) -> tuple[dict[str, torch.Tensor], dict]:
    """Stage 3: anchors H+ (with their slot and sequence) and negatives H-; returns the tensors
    and the stage's report. With ``parts`` every long pass saves its chunks there as they finish."""
    # along the target for requests, rewordings and chat forms; the prefixed requests only at their last
    # prompt token (the positions along the target are the request's own target text)
    r = seqs.along
    _, along = along_target_anchors(
        model,
        tokenizer,
        seqs.prompts + seqs.extra_prompts[:r],
        seqs.targets + seqs.extra_targets[:r],
        layer,
        cfg.max_target_tokens,
        cfg.experimental.anchor_predicted_targets,
        cfg.batch_size,
        parts,
    )
    last = chunked_states(
        parts,
        "prefixed_anchors",
        model,
        tokenizer,
        seqs.extra_prompts[r:],
        layer,
        [[len(p) - 1] for p in seqs.extra_prompts[r:]],
        "stage 3: prefixed anchor states",
    )
    anchors = StateBatch(torch.cat([along.states, last.states]), torch.cat([along.offsets, along.offsets[-1] + last.offsets[1:]]))
    pool = shared_negatives(model, tokenizer, layer, cache_dir, corpus, cfg, frozenset(s.subject for s in slots))
    pool = pool[not_anchors(pool, anchors.states)]
    # what the unedited model writes after each request, and answers to its chat forms: negatives
    # of every other slot
    with in_precision(model, cfg.negatives_dtype):
        cont, cont_owner = answer_states(
            model,
            tokenizer,
            seqs.prompts,
            list(range(len(slots))),
            layer,
            cfg.negative_continuation_tokens,
            cfg.batch_size,
            parts,
            "continuations",
        )
        chat = chat_forms(tokenizer, slots, cfg)
        chat_cont, chat_owner = answer_states(
            model,
            tokenizer,
            [ids for _, ids in chat],
            [i for i, _ in chat],
            layer,
            cfg.chat.negatives_chat_answer_tokens,
            cfg.batch_size,
            parts,
            "chat_answers",
        )
        specific, specific_owner = edit_negatives(model, tokenizer, slots, seqs, corpus, layer, cfg, rng, parts)
    keep = not_anchors(cont, anchors.states)
    chat_keep = not_anchors(chat_cont, anchors.states)
    info = {
        "anchors": int(anchors.states.shape[0]),
        "shared_negatives": int(pool.shape[0]),
        "edit_negatives": int(specific.shape[0]),
        "continuation_negatives": int(keep.sum()),
        "chat_answer_negatives": int(chat_keep.sum()),
        "paraphrase_positives": len(seqs.extra_prompts),
        "slots_with_paraphrases": len(set(seqs.extra_owner)),
    }
    tensors = {
        "anchors": anchors.states,
        "anchor_owner": seqs.seq_owner[anchors.owner()],
        "anchor_seq": anchors.owner(),
        "pool": pool,
        "specific": specific,
        "specific_owner": specific_owner,
        "continuations": torch.cat([cont[keep], chat_cont[chat_keep]]),
        "continuation_owner": torch.cat([cont_owner[keep], chat_owner[chat_keep]]),
    }
    return tensors, info
