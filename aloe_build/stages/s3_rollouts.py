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

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from aloe_kernels.hf import locate_down_proj

from ..checkpoints import PartStore
from ..chunked import chunked_states, chunked_tokens_and_states, continued
from ..config import BuildConfig
from ..corpus import Corpus, exclusion_prompts, relation_words, word_swapped_templates
from ..forward import Tick, in_precision, teacher_forced
from ..slots import Slot
from ..statement_keeps import after_statement
from ..states import StateBatch
from ..system_prompts import GENERIC_SYSTEM_PROMPTS
from ..tokens import (
    chat_answer,
    chat_header_length,
    chat_prompt,
    encode_continuation,
    encode_prompt,
    pad_id,
)
from .s3_shared_pool import pool_prompt_prefixes, shared_negatives


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

    def prefixed_mask(self, per_slot: int) -> torch.Tensor:
        """Over every anchor sequence: the first ``per_slot`` context positives of each slot (the
        request after corpus statements: required extras anchored at the last prompt token, not chat)."""
        mask = [False] * (len(self.prompts) + len(self.extra_prompts))
        taken = [0] * len(self.prompts)
        for k, (along, chat, soft, owner) in enumerate(zip(self.extra_along, self.extra_chat, self.extra_soft, self.extra_owner)):
            if not (along or chat or soft) and taken[owner] < per_slot:
                taken[owner] += 1
                mask[len(self.prompts) + k] = True
        return torch.tensor(mask, dtype=torch.bool)

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


def token_sequences(
    tokenizer, slots: Sequence[Slot], corpus: Corpus, cfg: BuildConfig, rewordings: Sequence[Sequence[str]] | None = None
) -> TokenSequences:
    """Requests, targets and the extra positives of every slot (each kind from its own generator,
    so that one does not change when another is switched on). ``rewordings``: each slot's rewordings
    written by the model (:func:`aloe_build.rewordings.generated_rewordings`), soft positives."""
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
    for i, texts in enumerate(rewordings or []):
        for text in texts:
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
    # and after prose (the sentences the corpus' rewordings open with), as a question in running text
    prose_rng = random.Random(cfg.seed + 5)
    for i, s in enumerate(slots if cfg.experimental.positives_prefixed_prose > 0 else []):
        for text in corpus.prefixed_prompts(s.prompt, cfg.experimental.positives_prefixed_prose, prose_rng, corpus.prose):
            seqs.add(encode_prompt(tokenizer, text), i, soft=False, along=False)
    # The request after generic system prompts: required anchors at the assistant header, where the
    # answer starts (the writes fitted on the default form carry to them).
    for i, ids in generic_system_forms(tokenizer, slots, cfg):
        seqs.add(ids, i, soft=False, along=False, chat=True)
    return seqs


def chat_forms(tokenizer, slots: Sequence[Slot], cfg: BuildConfig) -> list[tuple[int, list[int]]]:
    """(slot, token ids) of each request asked through the chat template, after the template's
    default system prompt and then after each of ``cfg.chat.chat_systems``; none without chat positives."""
    if not cfg.chat.positives_chat:
        return []
    return [
        (i, chat_prompt(tokenizer, s.prompt, system)) for system in (None, *cfg.chat.chat_systems) for i, s in enumerate(slots)
    ]


def generic_system_forms(tokenizer, slots: Sequence[Slot], cfg: BuildConfig) -> list[tuple[int, list[int]]]:
    """(slot, token ids) of each request asked after the slot's own draw of
    ``cfg.chat.positives_chat_generic_systems`` generic system prompts; none without chat positives."""
    k = cfg.chat.positives_chat_generic_systems if cfg.chat.positives_chat else 0
    forms = []
    for i, s in enumerate(slots if k else []):
        # seeded by the slot's request, so a slot's draw does not depend on the other edits (appends)
        rng = random.Random(f"{cfg.seed}\x00{s.prompt}")
        forms.extend((i, chat_prompt(tokenizer, s.prompt, system)) for system in rng.sample(GENERIC_SYSTEM_PROMPTS, k))
    return forms


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


def not_anchors(states: torch.Tensor, anchors: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Which states are not (numerically) an anchor: a corpus prompt identical to an edit's
    request must not become that edit's negative."""
    keep = torch.ones(states.shape[0], dtype=torch.bool)
    for start in range(0, states.shape[0], chunk):
        sim = states[start : start + chunk] @ anchors.T
        keep[start : start + chunk] = sim.max(1).values < 0.9999 if anchors.shape[0] else True
    return keep


def not_anchors_of_prompt(
    states: torch.Tensor, state_prompt: torch.Tensor, anchors: torch.Tensor, anchor_prompt: torch.Tensor
) -> torch.Tensor:
    """:func:`not_anchors` for states along continuations, each compared only with the anchors of
    sequences that share its prompt (the same id in ``state_prompt`` and ``anchor_prompt``). A state
    holds its prompt in its causal prefix, so it can only equal an anchor whose sequence begins with
    the same tokens: the unedited answer that starts like the target. The whole comparison would
    cost states x anchors, which grows with the square of the edits; this grows with them."""
    keep = torch.ones(states.shape[0], dtype=torch.bool)
    if not states.shape[0] or not anchors.shape[0]:
        return keep
    anchor_rows = _rows_by_group(anchor_prompt)
    for group, rows in _rows_by_group(state_prompt).items():
        if group in anchor_rows:
            keep[rows] = not_anchors(states[rows], anchors[anchor_rows[group]])
    return keep


def _rows_by_group(group: torch.Tensor) -> dict[int, torch.Tensor]:
    """The row indices of each group id, in one sort."""
    order = torch.argsort(group, stable=True)
    ids, counts = torch.unique_consecutive(group[order], return_counts=True)
    return dict(zip(ids.tolist(), torch.split(order, counts.tolist())))


def prompt_ids(prompts: Sequence[Sequence[int]], known: dict[tuple[int, ...], int]) -> torch.Tensor:
    """One id per distinct prompt (token for token), extending ``known`` with new prompts."""
    return torch.tensor([known.setdefault(tuple(p), len(known)) for p in prompts], dtype=torch.long)


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
        for t in in_turn(kinds, cfg.experimental.negatives_after_statement):  # the edit's fact in the context
            for chat in (False, True) if cfg.chat.positives_chat else (False,):
                ids, head = after_statement(tokenizer, s, t, chat)
                add(ids, range(head, len(ids)))
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


def anchor_states(model, tokenizer, seqs: TokenSequences, layer: int, cfg: BuildConfig, parts: PartStore | None) -> StateBatch:
    """The anchors H+ of every anchor sequence, grouped by sequence: along the target for requests,
    rewordings and chat forms; the prefixed requests only at their last prompt token (the positions
    along the target are the request's own target text)."""
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
    return StateBatch(torch.cat([along.states, last.states]), torch.cat([along.offsets, along.offsets[-1] + last.offsets[1:]]))


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
    anchors = anchor_states(model, tokenizer, seqs, layer, cfg, parts)
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
        chat_cont, chat_form = answer_states(
            model,
            tokenizer,
            [ids for _, ids in chat],
            list(range(len(chat))),
            layer,
            cfg.chat.negatives_chat_answer_tokens,
            cfg.batch_size,
            parts,
            "chat_answers",
        )
        specific, specific_owner = edit_negatives(model, tokenizer, slots, seqs, corpus, layer, cfg, rng, parts)
    known: dict[tuple[int, ...], int] = {}
    anchor_prompt = prompt_ids(seqs.prompts + seqs.extra_prompts, known)[anchors.owner()]
    keep = not_anchors_of_prompt(cont, prompt_ids(seqs.prompts, known)[cont_owner], anchors.states, anchor_prompt)
    chat_prompt = prompt_ids([ids for _, ids in chat], known)[chat_form]
    chat_keep = not_anchors_of_prompt(chat_cont, chat_prompt, anchors.states, anchor_prompt)
    chat_owner = torch.tensor([i for i, _ in chat], dtype=torch.long)[chat_form]
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
