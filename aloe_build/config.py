"""Every knob of the build pipeline, with the paper's defaults where it gives them."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class BuildConfig:
    """Configuration of :func:`aloe_build.build_operator`.

    Stage numbers follow the Method section of the paper: (1) address encoder,
    (2) address initialisation, (3) rollouts, (4) refinement, (5) calibration,
    (6) write targets, (7) joint ridge solve, (8) NLL fine-tuning of the writes.
    """

    layer: int | None = None  # edited decoder layer; None = the model family's default
    seed: int = 0
    batch_size: int = 32  # prompts per forward pass when collecting states
    compute_dtype: str = "float32"  # "bfloat16" runs the write stages (6, 8) under autocast

    # (1) address encoder, trained on a construction corpus disjoint from the edited stream
    encoder_corpus: str | None = None  # path of a CounterFact-style file; None = ../shared/data train split if present
    encoder_records: int = 4000  # corpus records used (states are collected once per model and layer)
    encoder_dim: int = 256  # p: rows of Q and K
    encoder_steps: int = 1500
    encoder_batch: int = 64  # records per relation-balanced minibatch
    encoder_lr: float = 2e-3
    encoder_margin: float = 0.2  # locality / same-subject margin m in score units
    encoder_ortho: float = 0.1  # weight of the key orthogonality penalty
    encoder_same_subject: int = 2  # same-subject other-relation prompts per corpus record
    encoder_cache: str | None = None  # directory of cached encoders; None = ~/.cache/aloe/encoders

    # (3) rollouts: anchors from the request and its target; negatives from other text
    # target tokens that get anchor states and are trained in stages 6-8. Longer targets are
    # produced only up to here: at 8, 47 of 52 KnowEdit recent targets over 8 tokens (dates such as
    # "0850-01-01T00:00:00Z") missed; no CounterFact target and 25 of 998 zsRE ones are longer than 8
    max_target_tokens: int = 32
    # keep as anchors the target positions whose token the unedited model already predicts from the
    # request and the target so far (they need no write; their states are the target text's own,
    # shared by the target quoted anywhere, e.g. KnowEdit's "<request>, which is not <target>, is")
    anchor_predicted_targets: bool = False
    negative_pool_records: int = 800  # corpus records whose prompts (all positions) form the shared negative pool
    # Greedy continuations of this many tokens by the unedited model are appended to the pool's
    # prompts and to every request; their states are negatives too (a request's own continuation
    # excepted). Without them no negative is a state the model passes through while it writes
    # text (at ".", "?" or a newline it generated), and on the 998 zsRE edits 44 of 49 locality
    # misses had their largest gate on such a token of the continuation, not on the prompt.
    negative_continuation_tokens: int = 16
    negatives_same_subject: int = 3  # other-relation templates filled with the edit's subject
    negatives_same_relation: int = 3  # the edit's template filled with other corpus subjects
    # other requests' templates of the edited stream (of another relation where both are known)
    # filled with the edit's subject: same-subject prompts in the stream's own phrasing, which
    # the corpus templates do not cover (on KnowEdit recent most locality misses were prompts
    # "The name of the <relation> of <subject> is" opening the subject's edit at " is")
    negatives_stream_templates: int = 8
    # the edit's template filled with other subjects of the stream (the corpus subjects above are
    # of another kind: on KnowEdit recent, slots such as "The date of birth of Waldram is" opened
    # at " is" on prompts about the stream's other, equally obscure subjects)
    negatives_stream_subjects: int = 8
    # the edit's template with one relation word swapped for another word of the stream's or the
    # corpus's templates, filled alternately with the edit's subject and another subject of the stream
    # (on KnowEdit recent a few "The date of birth of <obscure name> is" slots, barely separable from
    # their template with other subjects, opened on "The place of birth of <any name> is")
    negatives_word_swaps: int = 8
    # the request reworded to ask for a value other than its target ("The occupation of X, which is
    # not <target>, is"; requests ending in is/are/was/were only), negatives of its own slot. On
    # KnowEdit recent, whose Forgetfulness prompts take this form, 27 of 35 misses were the edit's own
    # slot opening on the target's tokens in the clause or on the final verb
    negatives_exclusions: int = 3
    # Paraphrase positives: other templates of the edit's relation (mined from the construction
    # corpus) filled with the edit's subject; soft anchors in stages 4-5 (see refine_soft_weight,
    # calibration_soft_floor) and, where their gate opens, training sequences in stages 6-8.
    # Off by default: on 200 CounterFact val edits (SmolLM2, layer 22; with 3 prefixed positives)
    # 8 per edit moved Eff/Gen/Loc from 1.000/0.015/0.980 to 1.000/0.090/0.945, below the locality floor.
    positives_same_relation: int = 0
    # Context positives: the request after this many true statements of the construction corpus
    # ("The mother tongue of Danielle Darrieux is French. <request>"), required anchors at the last
    # prompt token. Without them one unrelated sentence before a request shut the edit's gate: on
    # 200 CounterFact val edits, requests after sentences the build never saw gave the target
    # 0.128 of the time with none, 0.505 with 4 and 0.595 with 8 (locality 0.990, 0.985, 0.980)
    positives_prefixed: int = 4
    # How many of those come after a fragment of unrelated text that begins one of the corpus's
    # rephrases ("It was released in August 1990.") instead of a statement. Off by default: on 200
    # CounterFact val edits 2 of 4 took in-context efficacy from 0.505 to 0.532, on 200 zsRE edits
    # from 0.142 to 0.165 (generalization 0.055 -> 0.075, locality 1.000 -> 0.995), but on the whole
    # streams CounterFact 839 went 0.418 -> 0.420 and zsRE 998 stayed at 0.101
    positives_prefix_fragments: int = 0

    # (4) refinement (paper Eq. 5)
    refine_steps: int = 3000
    refine_lr: float = 0.01
    refine_margin: float = 0.1  # m_i as a fraction of |v_i|
    refine_hard_negatives: int = 32  # negatives per edit kept between re-minings
    refine_remine_every: int = 250
    refine_anchor_keep: float = 0.0  # pull towards the initial address (0 = the paper's loss alone)
    # weight of the paraphrase positives' own hinges (they stay out of the worst-anchor term, so
    # that a paraphrase the address cannot reach never makes its slot inseparable)
    refine_soft_weight: float = 1.0

    # (5) calibration
    open_gate: float = 0.9  # gate of the worst positive of a separable slot
    calibration_negative_slack: float = 2.0  # logits by which the worst negative sits below the dead-zone edge
    # where, as a fraction of the way from the worst negative to the worst anchor, a separable
    # slot's gate reaches open_gate (1.0: at the worst anchor, as in the paper). Lower values trade
    # locality for generalization; on 200 CounterFact val edits (SmolLM2, layer 22) Eff/Gen/Loc were
    # 1.000/0.015/0.985 at 1.0, 1.000/0.075/0.955 at 0.5 and 0.995/0.125/0.870 at 0.3.
    calibration_open_at: float = 1.0
    # a paraphrase positive sets where its gate reaches open_gate only if it clears the worst
    # negative by at least this fraction of the gap between the worst negative and the worst
    # request anchor (closer ones would need a gate steep enough to open on near-negatives)
    calibration_soft_floor: float = 0.5
    inseparable_temperature: float = 8.0  # initial alpha of inseparable slots (per unit |v|)
    calibration_steps: int = 200

    # (6) write targets
    target_steps: int = 25
    # further steps, up to this total, only for the edits of a batch whose target is not yet
    # produced greedily (some target token not the argmax); the others keep their delta
    target_max_steps: int = 50
    target_lr: float = 0.5
    # L2 weight on each write target. At 1e-3 the penalty (|delta| ~ 50 on SmolLM2 layer 22) outweighed
    # the target NLL and held zsRE targets at NLL ~1.4 however long stage 6 ran. On the 998 zsRE
    # edits 1e-4 gave Eff/Gen/Loc 0.979/0.081/0.951 and 3e-4 0.978/0.048/0.970: higher values keep
    # writes smaller and locality higher for some generalization
    target_l2: float = 1e-4
    target_rank: int = 16  # rank of each edit's down-projection change before it is evaluated on the anchor
    target_batch: int = 32

    # (7) joint ridge solve (paper Eq. 6)
    ridge_lambda: float = 1.0
    ridge_mu: float = 1e-3

    # (8) NLL fine-tuning of the writes, V, tau, alpha frozen
    finetune_steps: int = 100
    finetune_lr: float = 0.05
    finetune_batch: int = 64  # edits per step
    # Every this many steps, all training sequences are scored with the current writes and the next
    # steps draw only from those whose target is not yet produced greedily (stopping early when
    # none is left). With thousands of edits a plain pass gives each edit a handful of updates in
    # 100 steps; this spends them where the target is still missed. 0 = draw from all sequences.
    finetune_rescore_every: int = 25

    def fields_up_to(self, stage: int) -> dict[str, Any]:
        """The fields that stages 1..stage depend on (a checkpoint of that stage stays valid
        when only later fields change)."""
        return {k: v for k, v in self.to_dict().items() if _STAGE_OF.get(k.split("_")[0], 0) <= stage}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BuildConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"BuildConfig: unknown fields {sorted(unknown)}")
        return cls(**data)


# Which stage a field belongs to, by its prefix; fields without one (seed, batch size,
# compute dtype, layer) affect every stage.
_STAGE_OF = {
    "encoder": 1,
    "compute": 6,
    "max": 3,
    "anchor": 3,
    "negative": 3,
    "negatives": 3,
    "positives": 3,
    "refine": 4,
    "open": 5,
    "inseparable": 5,
    "calibration": 5,
    "target": 6,
    "ridge": 7,
    "finetune": 8,
}
