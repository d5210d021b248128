"""Every setting of the build pipeline, with the paper's defaults where it gives them.

:class:`BuildConfig` holds the stable settings, :class:`ChatConfig` (``BuildConfig.chat``) those of
edits asked through a chat template, and :class:`ExperimentalConfig` (``BuildConfig.experimental``)
the measured experiments that are off by default; setting one of those warns. Each field carries
its ``stage`` (0: every stage) and a ``help`` text in its metadata: ``aloe build --help`` and
docs/options.md are generated from them (``python -m aloe_cli.settings_doc``).

Keys are flat: ``BuildConfig(positives_chat=True)``, ``--set positives_chat=true`` and
:meth:`BuildConfig.to_dict` name every field by its own name, whichever group holds it. A stage's
checkpoint is keyed by the fields of that stage and the ones before it, so changing a later
stage's setting keeps the earlier checkpoints.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from typing import Any

from aloe_kernels.errors import AloeError
from aloe_kernels.reading import check_decay

from .system_prompts import GENERIC_SYSTEM_PROMPTS


class ConfigError(AloeError, ValueError):
    """A build setting that does not exist (a mistyped ``--set`` key, a stale config file)."""


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


#: ``_at(..., before=...)`` of a setting that every build had from the start.
_ALWAYS = object()


def _at(stage: int, default: Any, help: str, before: Any = _ALWAYS) -> Any:
    """A field of ``stage`` (0: every stage) with ``default`` and its ``help`` text. ``before``: for a
    setting added after checkpoints were written, the value that builds the way builds did before it;
    at that value it stays out of the checkpoint keys, so that those checkpoints stay valid."""
    return dataclasses.field(default=default, metadata={"stage": stage, "help": help, "before": before})


def changed_fields(group: Any) -> list[str]:
    """The fields of a group dataclass set away from their defaults."""
    return [f.name for f in dataclasses.fields(group) if getattr(group, f.name) != f.default]


@dataclasses.dataclass
class ChatConfig:
    """Edits that fire when the model is asked through its chat template (``BuildConfig.chat``).
    Every field but ``positives_chat`` only matters when it is on."""

    positives_chat: bool | None = _at(
        3,
        None,
        (
            "The request as the user turn of the model's chat template (its default system prompt), the "
            "target as the start of the answer: required anchors along the target and training sequences of "
            "the writes, so that an edit fires as a served chat model is asked. None ('auto'): on when the "
            "tokenizer has a chat template, off for a base model."
        ),
    )
    negatives_chat_pool: int = _at(
        3,
        400,
        (
            "Chat-form negatives: the requests and locality prompts of this many corpus records asked through "
            "the template (every position after the shared header, and the unedited answer's first tokens), "
            "shared by every edit and cached like the pool."
        ),
    )
    negatives_chat_own: int = _at(
        3,
        6,
        (
            "This many of each edit's own negative prompts, one of each kind in turn, asked through the "
            "template: negatives of its slot."
        ),
    )
    chat_systems: tuple[str, ...] = _at(
        3,
        (),
        (
            "More system prompts to build under (a deployment's own): each request is also asked after each "
            "of them, and the chat pool's records are shared out among the default and these prompts."
        ),
    )
    positives_chat_generic_systems: int = _at(
        3,
        6,
        (
            "Each request is also asked after this many of the generic system prompts "
            "(aloe_build.system_prompts), a different draw per edit: required anchors at the assistant "
            "header, so that an edit fires after a deployment's system prompt the build never saw."
        ),
        before=0,
    )
    negatives_chat_answer_tokens: int = _at(
        3,
        32,
        (
            "Tokens of the unedited model's answers to chat-form negatives, as far as a served answer is read "
            "(the chat evaluation reads 32)."
        ),
    )
    negatives_chat_systems: int = _at(
        3,
        32,
        (
            "The template's header after this many generic system prompts, every position, with a few pool "
            "questions and their answers: shared negatives, so that no slot opens on a system turn."
        ),
    )
    negatives_chat_questions: int = _at(
        3,
        400,
        (
            "Generic questions asked through the template, with their answers: a question-form request is "
            "addressed at the assistant header right after its question."
        ),
    )
    chat_slots: bool = _at(
        4,
        False,
        (
            "Each edit's chat forms get a slot of their own (after the requests' slots, with the edit's ids "
            "and form 'chat'), refined, calibrated at its worst anchor and written on its own. Doubles the "
            "slots (docs/results.md, 'One slot for the request, one for its chat forms')."
        ),
    )
    target_chat_forms: bool = _at(
        6,
        True,
        (
            "Fit each write target on the request and its chat forms together (KnowEdit recent: chat efficacy "
            "0.712 off, 0.979 on); off: the request alone, the chat forms left to stage 8."
        ),
    )

    def __post_init__(self) -> None:
        # ``--set chat_systems=TEXT`` gives one prompt, a JSON list several; a tuple either way
        if isinstance(self.chat_systems, str):
            self.chat_systems = (self.chat_systems,)
        self.chat_systems = tuple(self.chat_systems)
        if not all(isinstance(t, str) and t.strip() for t in self.chat_systems):
            raise ValueError("BuildConfig: chat_systems must be non-empty strings")
        if isinstance(self.positives_chat, str):  # as typed on a command line: true, False, auto, ...
            self.positives_chat = {"auto": None, "true": True, "false": False}.get(
                self.positives_chat.lower(), self.positives_chat
            )
        if self.positives_chat not in (None, True, False):
            raise ValueError(f"BuildConfig: positives_chat must be true, false or auto, got {self.positives_chat!r}")
        if self.chat_slots and self.positives_chat is False:
            raise ValueError("BuildConfig: chat_slots needs positives_chat (the chat forms are its anchors)")
        if not 0 <= self.positives_chat_generic_systems <= len(GENERIC_SYSTEM_PROMPTS):
            raise ValueError(
                f"BuildConfig: positives_chat_generic_systems must be between 0 and "
                f"{len(GENERIC_SYSTEM_PROMPTS)} (the generic system prompts there are)"
            )
        if not 0 <= self.negatives_chat_systems <= len(GENERIC_SYSTEM_PROMPTS):
            raise ValueError(
                f"BuildConfig: negatives_chat_systems must be between 0 and "
                f"{len(GENERIC_SYSTEM_PROMPTS)} (the generic system prompts there are)"
            )


@dataclasses.dataclass
class ExperimentalConfig:
    """Measured experiments, off by default (``BuildConfig.experimental``); setting one warns.
    Their measured effects are in docs/experiments.md."""

    negatives_after_statement: int = _at(
        3,
        0,
        (
            "Per edit, this many of its own negative prompts asked after its statement ('<request> <target>. "
            "<prompt>'; as a second user turn too with chat positives): their states after the statement are "
            "negatives of its slot, so the gate stays shut on other questions once the edit's fact is in the "
            "context."
        ),
        before=0,
    )
    finetune_keep_after_statement: int = _at(
        8,
        0,
        (
            "Questions asked after each edit's statement ('<request> <target>.'), plainly and with chat "
            "positives as a second user turn, whose unedited answers the fine-tuning keeps: the write "
            "fired on the statement must not change what the model says next (aloe_build.statement_keeps). "
            "On 100 zsRE edits it lowered the chat leak to target (0.04 -> 0.01) but changed more answers "
            "(0.83 -> 0.74) and cost efficacy (1.00 -> 0.97)."
        ),
        before=0,
    )
    encoder_batch_negatives: bool = _at(
        1,
        False,
        (
            "Each key also ranks its paraphrase above the locality inputs and same-subject prompts of every "
            "other batch item, not only its own."
        ),
    )
    encoder_threshold_weight: float = _at(
        1,
        0.0,
        (
            "Weight of a logistic loss of every score of a batch against one learned threshold. With "
            "encoder_batch_negatives the mechanism study improves, but a 6-edit build with a short stage 1 "
            "made 2 of its 6 edits instead of 5 or more."
        ),
    )
    encoder_dropout: float = _at(
        1,
        0.0,
        (
            "Share of each training state's coordinates zeroed at every step before it is renormalized "
            "(narrows the encoder's train/new gap)."
        ),
    )
    encoder_members: int = _at(
        1, 1, ("Encoders trained from different seeds whose addresses are averaged (still one address per edit).")
    )
    anchor_predicted_targets: bool = _at(
        3, False, ("Keep as anchors the target positions whose token the unedited model already predicts.")
    )
    negatives_paraphrases: int = _at(
        3,
        0,
        (
            "Rewordings of this many corpus requests (not about an edited subject) in the shared negatives, "
            "so that a slot stays shut on other subjects' facts asked in new words."
        ),
    )
    positives_same_relation: int = _at(
        3,
        0,
        (
            "Paraphrase positives: other templates of the edit's relation filled with its subject; soft "
            "anchors in stages 4-5 and training sequences where their gate opens. Raises generalization at "
            "a cost in locality."
        ),
    )
    positives_prefix_pool: int = _at(
        3,
        0,
        (
            "Draw the context positives' statements from this many corpus statements picked once per build "
            "(0: from all), so that stage 3 shares their prefixes."
        ),
    )
    positives_prefixed_prose: int = _at(
        3, 0, "Context positives after this many sentences the corpus' rewordings open with, per edit.", before=0
    )
    refine_flat_stop: float = _at(
        4,
        0.0,
        (
            "Stop refinement at a re-mining once the loss there is within this fraction below the loss at "
            "the previous one (0: run until every slot meets its margin, refine_steps at most)."
        ),
    )
    refine_pull: float = _at(
        4,
        0.0,
        (
            "A second refinement run that pulls every address this fraction of refine_lr back towards its "
            "stage-2 address each step; each slot keeps the pulled address where it still separates."
        ),
    )
    positives_generated: int = _at(
        3,
        0,
        (
            "Paraphrase positives the model writes itself: up to this many rewordings of each request, "
            "completed greedily after few-shot examples and kept where they name the subject and share a "
            "word of its relation (aloe_build.rewordings); soft anchors like positives_same_relation."
        ),
        before=0,
    )
    refine_soft_weight: float = _at(4, 1.0, ("Weight of the paraphrase positives' own hinges (with positives_same_relation)."))
    calibration_soft_floor: float = _at(
        5,
        0.5,
        (
            "A paraphrase positive sets where its gate opens only if it clears the worst negative by this "
            "fraction of the gap to the worst request anchor (with positives_same_relation)."
        ),
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.encoder_dropout < 1.0:
            raise ValueError(f"BuildConfig: encoder_dropout must be in [0, 1), got {self.encoder_dropout}")
        if self.encoder_members < 1:
            raise ValueError(f"BuildConfig: encoder_members must be at least 1, got {self.encoder_members}")


#: The groups of :class:`BuildConfig`, by attribute name.
GROUPS: dict[str, type] = {"chat": ChatConfig, "experimental": ExperimentalConfig}


@dataclasses.dataclass
class BuildConfig:
    """Configuration of :func:`aloe_build.build_operator` (stages listed in :data:`STAGES`).

    Fields of the groups may be given flat: ``BuildConfig(positives_chat=True)`` sets
    ``config.chat.positives_chat``. :meth:`preset` gives the named settings of docs/options.md."""

    layer: int | None = _at(0, None, "Edited decoder layer; None: the model family's default.")
    seed: int = _at(0, 0, "Seed of every random choice of the build.")
    batch_size: int = _at(0, 32, "Prompts per forward pass when collecting states.")
    reading_decay: float = _at(
        0,
        0.0,
        (
            "What the gates read (aloe_kernels.reading): 0, the state at the current token; d in (0, 1), "
            "the running mean of every token's unit state so far, each earlier token weighing d times the "
            "next, so that the whole question asked, not its last token, addresses the edit."
        ),
        before=0.0,
    )
    compute_dtype: str = _at(6, "float32", "'bfloat16' runs the write stages (6, 8) under autocast.")

    encoder_corpus: str | None = _at(
        1,
        None,
        (
            "CounterFact-style file the address encoder trains on (disjoint from the edited stream); None: "
            "the bundled first 4,000 records of CounterFact train."
        ),
    )
    encoder_records: int = _at(1, 4000, "Corpus records used (states are collected once per model and layer).")
    encoder_dim: int = _at(1, 256, "p: rows of Q and K.")
    encoder_steps: int = _at(1, 1500, "Training steps of the encoder.")
    encoder_batch: int = _at(1, 64, "Records per relation-balanced minibatch.")
    encoder_lr: float = _at(1, 2e-3, "Learning rate of the encoder.")
    encoder_margin: float = _at(1, 0.2, "Locality and same-subject margin m, in score units.")
    encoder_ortho: float = _at(1, 0.1, "Weight of the key orthogonality penalty.")
    encoder_same_subject: int = _at(1, 2, "Same-subject other-relation prompts per corpus record.")
    encoder_same_subject_keys: bool = _at(
        1,
        True,
        (
            "The same-subject prompts also compete as keys: each paraphrase must pick its own request over "
            "keys of its subject under other relations (the paper's 16-way test)."
        ),
    )
    encoder_cache: str | None = _at(1, None, "Directory of cached encoders; None: $ALOE_CACHE/encoders.")

    max_target_tokens: int = _at(3, 32, "Target tokens that get anchor states and are trained in stages 6-8.")
    negative_pool_records: int = _at(3, 800, "Corpus records whose prompts (all positions) are shared negatives.")
    negative_continuation_tokens: int = _at(
        3,
        16,
        (
            "Greedy continuations of this many tokens by the unedited model, appended to the pool's prompts "
            "and to every request: negatives too, so that slots stay shut on the tokens a model writes."
        ),
    )
    negatives_questions: int = _at(
        3,
        800,
        (
            "Generic questions about corpus subjects in the shared pool with their continuations, so that a "
            "slot stays shut on unrelated questions and their answers."
        ),
    )
    negatives_distracting: int = _at(
        3,
        300,
        (
            "Shared negatives of every slot: this many corpus statements, each followed by a same-relation "
            "request about another subject (plainly, and with chat positives as a second user turn), at the "
            "positions after the statement, so that no gate opens on a question asked after another fact "
            "is stated. Computed once per model, layer and corpus and cached with the shared pool."
        ),
        before=0,
    )
    negatives_dtype: str = _at(
        3,
        "float32",
        (
            "Precision of the passes that make each edit's negatives; 'bfloat16' is faster on CPUs with AMX or "
            "AVX512-BF16 (and much slower without them)."
        ),
    )
    negatives_same_subject: int = _at(3, 3, "Other-relation templates filled with the edit's subject.")
    negatives_same_relation: int = _at(3, 3, "The edit's template filled with other corpus subjects.")
    negatives_stream_templates: int = _at(3, 8, "Other requests' templates of the stream filled with the edit's subject.")
    negatives_stream_subjects: int = _at(3, 8, "The edit's template filled with other subjects of the stream.")
    negatives_word_swaps: int = _at(3, 8, "The edit's template with one relation word swapped for another.")
    negatives_exclusions: int = _at(
        3,
        3,
        (
            "The request reworded to ask for a value other than its target ('The occupation of X, which is not "
            "<target>, is'), negatives of its own slot."
        ),
    )
    positives_prefixed: int = _at(
        3,
        4,
        (
            "Context positives: the request after this many true corpus statements, required anchors at the "
            "last prompt token, so that an edit fires after unrelated text."
        ),
    )

    refine_steps: int = _at(4, 3000, "Refinement runs until every slot clears its margin, this many steps at most.")
    refine_lr: float = _at(4, 0.01, "Learning rate of the refinement.")
    refine_margin: float = _at(4, 0.1, "m_i as a fraction of |v_i|.")
    refine_hard_negatives: int = _at(4, 8, "Negatives per edit kept between re-minings (most of a step's cost).")
    refine_remine_every: int = _at(4, 250, "Steps between re-minings of the hardest negatives.")
    refine_candidates: int = _at(
        4,
        512,
        (
            "Shared negatives kept per slot at its full mining; a slot is mined in full again once its address "
            "has moved far enough, so every re-mining is exact (0: every re-mining scores the whole pool)."
        ),
    )
    refine_active_every: int = _at(
        4, 25, ("Steps run on the slots whose hinge is not yet met, re-selected this often (0: every slot, every step).")
    )

    open_gate: float = _at(5, 0.9, "Gate of the worst positive of a separable slot.")
    calibration_negative_slack: float = _at(5, 2.0, "Logits by which the worst negative sits below the dead zone.")
    calibration_open_at: float = _at(
        5,
        1.0,
        (
            "Where, from the worst negative (0) to the worst anchor (1), a separable slot's gate reaches "
            "open_gate; lower values trade locality for generalization, and for chat efficacy after a system "
            "prompt the build never saw (docs/experiments.md)."
        ),
    )
    inseparable_temperature: float = _at(5, 8.0, "Initial alpha of inseparable slots, per unit |v|.")
    calibration_steps: int = _at(5, 200, "Steps of the inseparable slots' midpoint fit.")

    target_steps: int = _at(6, 25, "Steps of each batch of write targets.")
    target_max_steps: int = _at(6, 50, "Further steps, up to this total, for edits whose target is not yet produced.")
    target_lr: float = _at(6, 0.5, "Learning rate of the write targets.")
    target_stop_nll: float = _at(
        6, 0.02, ("An edit leaves its batch early once its target is produced and its mean NLL is at most this (0: never).")
    )
    target_l2: float = _at(6, 1e-4, "L2 weight on each write target: smaller writes, higher locality.")
    target_rank: int = _at(6, 16, "Rank of each edit's down-projection change before it is evaluated on the anchor.")
    target_batch: int = _at(6, 64, "Edits per batch of write targets.")

    ridge_lambda: float = _at(7, 1.0, "Weight of the negatives' gates in the ridge solve (paper Eq. 6).")
    ridge_mu: float = _at(7, 1e-3, "Ridge regulariser mu.")

    finetune_steps: int = _at(8, 100, "NLL fine-tuning steps of the writes (V, tau, alpha frozen).")
    finetune_lr: float = _at(8, 0.05, "Learning rate of the fine-tuning.")
    finetune_batch: int = _at(8, 64, "Edits per fine-tuning step.")
    finetune_rescore_every: int = _at(
        8, 25, ("Every this many steps, draw only from the sequences whose target is not yet produced (0: from all).")
    )
    positives_prefixed_written: int = _at(
        8, 0, "Of each edit's context positives (positives_prefixed), this many also train its write.", before=0
    )

    chat: ChatConfig = dataclasses.field(default_factory=ChatConfig, metadata={"group": True})
    experimental: ExperimentalConfig = dataclasses.field(default_factory=ExperimentalConfig, metadata={"group": True})

    def __post_init__(self) -> None:
        from .forward import autocast_dtype  # the one list of pass precisions

        try:
            self.reading_decay = check_decay(self.reading_decay)
        except ValueError as err:
            raise ValueError(f"BuildConfig: {err}") from None

        for name in ("compute_dtype", "negatives_dtype"):
            try:
                autocast_dtype(getattr(self, name))
            except ValueError as err:
                raise ValueError(f"BuildConfig: {name}: {err}") from None
        changed = changed_fields(self.experimental)
        if changed:
            warnings.warn(
                f"BuildConfig: experimental settings {changed} (off by default; measured effects in docs/experiments.md)",
                stacklevel=4,
            )
        unused = [name for name in changed_fields(self.chat) if name != "positives_chat"]
        if unused and self.chat.positives_chat is False:
            warnings.warn(f"BuildConfig: {unused} have no effect without positives_chat", stacklevel=4)

    def for_tokenizer(self, tokenizer) -> "BuildConfig":
        """These settings with ``positives_chat`` decided: left as given when set, else on exactly
        when ``tokenizer`` has a chat template (a chat model is served through it). A build records
        the decided value, so an append keeps it."""
        has_template = bool(getattr(tokenizer, "chat_template", None))
        chat = self.chat.positives_chat
        if chat is None:
            chat = has_template
        if chat and not has_template:
            raise ValueError("BuildConfig: positives_chat is on but the tokenizer has no chat template")
        if self.chat.chat_slots and not chat:
            raise ValueError("BuildConfig: chat_slots needs positives_chat, and the tokenizer has no chat template")
        decided = copy.deepcopy(self)  # not replace(): the settings were checked, warn only once
        decided.chat.positives_chat = chat
        return decided

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "BuildConfig":
        """The named settings of :data:`aloe_build.presets.PRESETS`, with ``overrides`` on top (a key that
        is no setting: :class:`ConfigError`)."""
        from .presets import preset_fields

        return cls.from_dict({**preset_fields(name), **overrides})

    @classmethod
    def field_specs(cls) -> list[dataclasses.Field]:
        """Every setting's field, the groups' flattened in: name, default, ``stage`` and ``help``."""
        out = []
        for f in dataclasses.fields(cls):
            out.extend(dataclasses.fields(GROUPS[f.name]) if f.metadata.get("group") else [f])
        return out

    def fields_up_to(self, stage: int) -> dict[str, Any]:
        """The fields that stages 1..stage depend on (a checkpoint of that stage stays valid
        when only later fields change)."""
        values = self.to_dict()
        return {
            f.name: values[f.name]
            for f in self.field_specs()
            if f.metadata["stage"] <= stage and values[f.name] != f.metadata["before"]
        }

    def fields_of(self, stage: int) -> dict[str, Any]:
        """The fields of one stage only (not those every stage depends on)."""
        values = self.to_dict()
        return {f.name: values[f.name] for f in self.field_specs() if f.metadata["stage"] == stage}

    def to_dict(self) -> dict[str, Any]:
        """Every field by its own name, the groups' flattened in."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("group")}
        for group in GROUPS:
            out.update(dataclasses.asdict(getattr(self, group)))
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BuildConfig":
        """From flat keys (as :meth:`to_dict` writes them); an unknown key is an error."""
        unknown = set(data) - {f.name for f in cls.field_specs()}
        if unknown:
            raise ConfigError(f"BuildConfig: unknown fields {sorted(unknown)} (docs/options.md lists them)")
        return cls(**data)


def _flat_init(cls: type) -> type:
    """Let ``cls(...)`` take the groups' fields by their own names (``positives_chat=True``), on
    top of a group object given whole; :func:`dataclasses.replace` goes through here too."""
    init = cls.__init__

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        for group, group_cls in GROUPS.items():
            names = {f.name for f in dataclasses.fields(group_cls)}
            flat = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
            if flat:
                base = kwargs.get(group)
                kwargs[group] = dataclasses.replace(base, **flat) if base is not None else group_cls(**flat)
        init(self, *args, **kwargs)

    cls.__init__ = __init__
    return cls


_flat_init(BuildConfig)


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
