"""Every knob of the build pipeline, with the paper's defaults where it gives them.

Each field declares the stage it belongs to (``stage`` in its metadata; 0 for
fields every stage depends on). A stage's checkpoint is keyed by the fields
of that stage and the ones before it, so changing a later stage's setting
keeps the earlier checkpoints; the measured effect of each setting is in
``docs/results.md``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .system_prompts import GENERIC_SYSTEM_PROMPTS

#: Stage numbers of the paper's Method section.
STAGES = {
    1: "address encoder",
    2: "address initialisation",
    3: "rollouts",
    4: "refinement",
    5: "calibration",
    6: "write targets",
    7: "joint ridge solve",
    8: "NLL fine-tuning",
}


def _at(stage: int, default: Any) -> Any:
    """A field of ``stage`` (0: every stage) with ``default``."""
    return dataclasses.field(default=default, metadata={"stage": stage})


@dataclasses.dataclass
class BuildConfig:
    """Configuration of :func:`aloe_build.build_operator` (stages listed in :data:`STAGES`)."""

    layer: int | None = _at(0, None)  # edited decoder layer; None = the model family's default
    seed: int = _at(0, 0)
    batch_size: int = _at(0, 32)  # prompts per forward pass when collecting states
    compute_dtype: str = _at(6, "float32")  # "bfloat16" runs the write stages (6, 8) under autocast

    # (1) address encoder, trained on a construction corpus disjoint from the edited stream
    encoder_corpus: str | None = _at(1, None)  # CounterFact-style file; None = the bundled corpus
    encoder_records: int = _at(1, 4000)  # corpus records used (states are collected once per model and layer)
    encoder_dim: int = _at(1, 256)  # p: rows of Q and K
    encoder_steps: int = _at(1, 1500)
    encoder_batch: int = _at(1, 64)  # records per relation-balanced minibatch
    encoder_lr: float = _at(1, 2e-3)
    encoder_margin: float = _at(1, 0.2)  # locality / same-subject margin m in score units
    encoder_ortho: float = _at(1, 0.1)  # weight of the key orthogonality penalty
    encoder_same_subject: int = _at(1, 2)  # same-subject other-relation prompts per corpus record
    # the same-subject prompts also serve as competing keys: each paraphrase must pick its own
    # request over keys of its subject under other relations (the 16-way test of the paper)
    encoder_same_subject_keys: bool = _at(1, True)
    # each key also ranks its paraphrase above the locality inputs and same-subject prompts of every
    # other batch item (other subjects' facts of its own relation among them), not only its own
    encoder_batch_negatives: bool = _at(1, False)
    # weight of a logistic loss of every positive and negative score of a batch against one learned
    # threshold: the ranking losses are per key, and this makes one threshold serve every key.
    # Both off by default: with both on, the mechanism study improves (docs/results.md) but a small
    # 6-edit SmolLM2 build with a short stage 1 made 2 of its 6 edits instead of 5 or more
    encoder_threshold_weight: float = _at(1, 0.0)
    # share of each training state's coordinates zeroed at every step before it is renormalized:
    # the encoder fits its training items far better than new ones (locality AUC 0.990 against
    # 0.956), and dropout narrows that gap (docs/results.md, "The encoder overfits its training items")
    encoder_dropout: float = _at(1, 0.0)
    # encoders trained from different seeds whose addresses are averaged (still one address per edit,
    # so serving is unchanged): each member's errors are partly its own (docs/results.md, "Several
    # encoders, one address")
    encoder_members: int = _at(1, 1)
    encoder_cache: str | None = _at(1, None)  # directory of cached encoders; None = $ALOE_CACHE/encoders

    # (3) rollouts: anchors from the request and its target; negatives from other text
    # target tokens that get anchor states and are trained in stages 6-8 (longer targets are
    # produced only up to here)
    max_target_tokens: int = _at(3, 32)
    # keep as anchors the target positions whose token the unedited model already predicts from the
    # request and the target so far (they need no write, and their states are the target text's own,
    # which the target quoted in any other context shares)
    anchor_predicted_targets: bool = _at(3, False)
    negative_pool_records: int = _at(3, 800)  # corpus records whose prompts (all positions) are shared negatives
    # greedy continuations of this many tokens by the unedited model, appended to the pool's prompts
    # and to every request; their states are negatives too (a request's own continuation excepted),
    # so that slots stay shut on the tokens a model writes
    negative_continuation_tokens: int = _at(3, 16)
    # rewordings of the first this many corpus requests (their paraphrase prompts, "X is incredible
    # at"), except those about an edited subject, in the shared pool with their continuations, so that
    # a slot stays shut on other subjects' facts asked in words its negatives did not hold (0: none)
    negatives_paraphrases: int = _at(3, 0)
    # generic questions about corpus subjects (questions.QUESTION_FRAMES; every other one a lower-case
    # query without its question mark) in the shared pool with their continuations, so that a slot
    # stays shut on the question marks of unrelated questions and the answers that follow (0: none)
    negatives_questions: int = _at(3, 800)
    # precision of the forward passes that make each edit's negatives (the request continuations,
    # the chat answers, the edit's own negative prompts): "bfloat16" runs them under autocast, which
    # on CPUs with AMX is about three times faster; the anchors and the shared pool stay in the
    # model's dtype
    negatives_dtype: str = _at(3, "float32")
    negatives_same_subject: int = _at(3, 3)  # other-relation templates filled with the edit's subject
    negatives_same_relation: int = _at(3, 3)  # the edit's template filled with other corpus subjects
    # other requests' templates of the edited stream (of another relation where both are known)
    # filled with the edit's subject: same-subject prompts in the stream's own phrasing
    negatives_stream_templates: int = _at(3, 8)
    # the edit's template filled with other subjects of the stream
    negatives_stream_subjects: int = _at(3, 8)
    # the edit's template with one relation word swapped for another word of the stream's or the
    # corpus's templates, filled alternately with the edit's subject and another stream subject
    negatives_word_swaps: int = _at(3, 8)
    # the request reworded to ask for a value other than its target ("The occupation of X, which is
    # not <target>, is"; requests ending in is/are/was/were only), negatives of its own slot
    negatives_exclusions: int = _at(3, 3)
    # Paraphrase positives: other templates of the edit's relation (from the construction corpus)
    # filled with the edit's subject; soft anchors in stages 4-5 (see refine_soft_weight,
    # calibration_soft_floor) and, where their gate opens, training sequences in stages 6-8.
    # Raises generalization to rewordings at a cost in locality; off by default.
    positives_same_relation: int = _at(3, 0)
    # Context positives: the request after this many true statements of the construction corpus,
    # required anchors at the last prompt token, so that an edit fires after unrelated text
    positives_prefixed: int = _at(3, 4)
    # ... drawn from this many corpus statements, picked once per build (0: from all of them), so
    # that one statement stands before many requests and runs through the model once for all of
    # them (stage 3 shares prefixes); each request still gets its own random few. 256 is measured in
    # docs/results.md ("On an AVX-512 CPU"); off until a light build's efficacy is checked with it
    positives_prefix_pool: int = _at(3, 0)
    # Chat positives: the request as the user turn of the model's chat template (its default
    # system prompt), the target as the start of the answer; required anchors along the target and
    # training sequences of the writes, so that an edit fires as a served chat model is asked
    positives_chat: bool = _at(3, False)
    # With chat positives, chat-form negatives: the requests and locality prompts of the first this
    # many corpus records asked through the same template (every position after the shared header,
    # and the unedited answer's first tokens), shared by every edit and cached like the pool...
    negatives_chat_pool: int = _at(3, 400)
    # ...and this many of each edit's own negative prompts, one of each kind in turn (another relation
    # of its subject, its relation of another subject, ..., the exclusion rewording), asked the same
    # way, negatives of its slot
    negatives_chat_own: int = _at(3, 6)
    # With chat positives, more system prompts to build under (a deployment's own, for example):
    # each request is also asked after each of them, and the chat-form pool's records are shared
    # out among the default and these prompts in turn (the pool keeps its size)
    chat_systems: tuple[str, ...] = _at(3, ())
    # With chat positives, the unedited model's answers to chat-form negatives run this many tokens,
    # as far as a served answer is read (the chat evaluation reads 32); the answers to each request's
    # chat forms are negatives of every other slot, as its plain continuation is
    negatives_chat_answer_tokens: int = _at(3, 32)
    # With chat positives, the template's header after this many generic system prompts
    # (system_prompts.GENERIC_SYSTEM_PROMPTS), every position, and a few pool questions asked after
    # each, with their answers: shared negatives, so that no slot opens on a system turn it was not
    # built under (one that does changes every answer served with it)
    negatives_chat_systems: int = _at(3, 32)
    # With chat positives, this many generic questions (as negatives_questions makes them) asked
    # through the template as well, after the default and the chat_systems prompts in turn, with
    # their answers: a question-form request is addressed at the assistant header right after its
    # question, where the corpus statements in chat form never reach
    negatives_chat_questions: int = _at(3, 400)

    # (4) refinement (paper Eq. 5): steps until every slot clears its margin against its hardest
    # negatives, this many at most
    refine_steps: int = _at(4, 3000)
    refine_lr: float = _at(4, 0.01)
    refine_margin: float = _at(4, 0.1)  # m_i as a fraction of |v_i|
    # negatives per edit kept between re-minings; every step reads them all, so this sets most of
    # a step's cost (32 -> 8: stage 4 at 0.58 of the CPU time, the same efficacy and locality,
    # one rewording fewer on CounterFact 839 and on a zsRE slice; docs/results.md)
    refine_hard_negatives: int = _at(4, 8)
    refine_remine_every: int = _at(4, 250)
    # Shared negatives kept per slot at its full mining: the re-minings after it score only these and
    # the slot's own negatives, not the whole pool, which grows with the stream. A slot is mined in full
    # again once its address has moved far enough that a state outside them could be among its hardest,
    # so every re-mining is exact (0: every re-mining scores the whole pool).
    refine_candidates: int = _at(4, 512)
    # Steps run on the slots whose hinge is not yet met, re-selected this often (and at every
    # re-mining); a slot that meets its margin stays where it is until then (0: every slot, every
    # step). The cost of a step then follows the slots still violating, not the stream's size.
    refine_active_every: int = _at(4, 25)
    # Stop at a re-mining once the loss there is within this fraction below the loss at the
    # previous one (the slots left violating are the inseparable ones; a rise, from newly mined
    # negatives, goes on). 0: run every step unless every slot meets its margin.
    refine_flat_stop: float = _at(4, 0.0)
    # weight of the paraphrase positives' own hinges (they stay out of the worst-anchor term, so
    # that a paraphrase the address cannot reach never makes its slot inseparable)
    refine_soft_weight: float = _at(4, 1.0)
    # A second run of the steps that also moves every address this fraction of refine_lr back
    # towards its stage-2 (encoder) address each step, as decoupled weight decay does towards zero;
    # each slot keeps that address where it still separates its anchors from every negative, and
    # the free one elsewhere. The kept ones hold more of the encoder's geometry, which carries
    # rewordings (0: off; docs/results.md, "Refinement held near the encoder")
    refine_pull: float = _at(4, 0.0)
    # With chat positives, each edit's chat forms get a slot of their own (stored after the requests'
    # slots, with the edit's ids and ``"form": "chat"``): its anchors are the chat forms, the request's
    # slot keeps the request and its prefixed forms, and each is refined, calibrated and written on its
    # own. The chat slot is calibrated at its worst anchor whatever ``calibration_open_at`` says, so
    # that wider gates for rewordings do not widen the gates that open at a chat template's assistant
    # header, which every conversation passes (docs/results.md, "One slot for the request, one for its
    # chat forms"). Doubles the slots.
    chat_slots: bool = _at(4, False)

    # (5) calibration
    open_gate: float = _at(5, 0.9)  # gate of the worst positive of a separable slot
    calibration_negative_slack: float = _at(5, 2.0)  # logits by which the worst negative sits below the dead zone
    # where, as a fraction of the way from the worst negative to the worst anchor, a separable
    # slot's gate reaches open_gate (1.0: at the worst anchor, as in the paper); lower values trade
    # locality for generalization
    calibration_open_at: float = _at(5, 1.0)
    # a paraphrase positive sets where its gate reaches open_gate only if it clears the worst
    # negative by at least this fraction of the gap between the worst negative and the worst
    # request anchor (closer ones would need a gate steep enough to open on near-negatives)
    calibration_soft_floor: float = _at(5, 0.5)
    inseparable_temperature: float = _at(5, 8.0)  # initial alpha of inseparable slots (per unit |v|)
    calibration_steps: int = _at(5, 200)

    # (6) write targets
    target_steps: int = _at(6, 25)
    # further steps, up to this total, only for the edits of a batch whose target is not yet
    # produced greedily (some target token not the argmax); the others keep their delta
    target_max_steps: int = _at(6, 50)
    target_lr: float = _at(6, 0.5)
    # an edit also leaves its batch before target_steps once its target is produced and its mean
    # target NLL is at most this (0: never before target_steps); 0.02 took stage 6 of the 1,301-edit
    # CounterFact build from 252 to 183 s, and CounterFact and zsRE scored the same with it
    # (docs/results.md, "On an AVX-512 CPU" and "Stage 6 stops an edit early, on zsRE too")
    target_stop_nll: float = _at(6, 0.02)
    # L2 weight on each write target: higher values keep writes smaller and locality higher at
    # some cost in generalization; too high a value holds targets short of being produced
    target_l2: float = _at(6, 1e-4)
    target_rank: int = _at(6, 16)  # rank of each edit's down-projection change before it is evaluated on the anchor
    # a step streams every upper-layer and vocabulary weight however many edits it holds (on the
    # AVX-512 CPU about 60 ms plus 5 ms per edit), so a batch of 64 amortises that better than 32:
    # stage 6 of the 1,301-edit CounterFact build took 0.88 of the time, the same writes to rounding
    # (docs/results.md, "Stage 6 in batches of 64")
    target_batch: int = _at(6, 64)
    # with chat positives, fit each write target on the request and its chat forms together (mean of
    # their NLLs; an edit counts as produced once all of them are). Off: the request alone, and the chat
    # forms are left to stage 8, which starts from a write that does not produce them (KnowEdit recent:
    # chat efficacy 0.712 off, 0.979 on; docs/results.md)
    target_chat_forms: bool = _at(6, True)

    # (7) joint ridge solve (paper Eq. 6)
    ridge_lambda: float = _at(7, 1.0)
    ridge_mu: float = _at(7, 1e-3)

    # (8) NLL fine-tuning of the writes, V, tau, alpha frozen
    finetune_steps: int = _at(8, 100)
    finetune_lr: float = _at(8, 0.05)
    finetune_batch: int = _at(8, 64)  # edits per step
    # Every this many steps, all training sequences are scored with the current writes and the next
    # steps draw only from those whose target is not yet produced greedily (stopping early when
    # none is left), so that updates go where the target is still missed. 0 = draw from all sequences.
    finetune_rescore_every: int = _at(8, 25)

    def __post_init__(self) -> None:
        # ``--set chat_systems=TEXT`` gives one prompt, a JSON list several; a tuple either way
        if isinstance(self.chat_systems, str):
            self.chat_systems = (self.chat_systems,)
        self.chat_systems = tuple(self.chat_systems)
        if not all(isinstance(t, str) and t.strip() for t in self.chat_systems):
            raise ValueError("BuildConfig: chat_systems must be non-empty strings")
        from .forward import autocast_dtype  # the one list of pass precisions

        for name in ("compute_dtype", "negatives_dtype"):
            try:
                autocast_dtype(getattr(self, name))
            except ValueError as err:
                raise ValueError(f"BuildConfig: {name}: {err}") from None
        if not 0.0 <= self.encoder_dropout < 1.0:
            raise ValueError(f"BuildConfig: encoder_dropout must be in [0, 1), got {self.encoder_dropout}")
        if self.encoder_members < 1:
            raise ValueError(f"BuildConfig: encoder_members must be at least 1, got {self.encoder_members}")
        if self.chat_slots and not self.positives_chat:
            raise ValueError("BuildConfig: chat_slots needs positives_chat (the chat forms are its anchors)")
        if not 0 <= self.negatives_chat_systems <= len(GENERIC_SYSTEM_PROMPTS):
            raise ValueError(f"BuildConfig: negatives_chat_systems must be between 0 and "
                             f"{len(GENERIC_SYSTEM_PROMPTS)} (the generic system prompts there are)")

    def fields_up_to(self, stage: int) -> dict[str, Any]:
        """The fields that stages 1..stage depend on (a checkpoint of that stage stays valid
        when only later fields change)."""
        values = self.to_dict()
        return {f.name: values[f.name] for f in dataclasses.fields(self) if f.metadata["stage"] <= stage}

    def fields_of(self, stage: int) -> dict[str, Any]:
        """The fields of one stage only (not those every stage depends on)."""
        values = self.to_dict()
        return {f.name: values[f.name] for f in dataclasses.fields(self) if f.metadata["stage"] == stage}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BuildConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"BuildConfig: unknown fields {sorted(unknown)}")
        return cls(**data)


def parse_settings(items: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` texts (``aloe build --set``) as BuildConfig fields: a value is JSON where it parses
    (numbers, true/false/null, lists, quoted strings), else the text itself, so that
    ``negatives_dtype=float32`` is the string it reads as."""
    import json

    out: dict[str, Any] = {}
    for item in items:
        key, _, text = item.partition("=")
        try:
            out[key] = json.loads(text)
        except json.JSONDecodeError:
            out[key] = text
    return out

