"""The edit-request data classes, their validation, and the error the loaders raise.

:class:`EditRequest` is what everything downstream works on; :class:`LocalityPrompt`
and :class:`PortabilityPrompt` are its probes. Every field is normalised on
construction: texts stripped, ground truths flattened by :func:`normalize_answers`,
lists turned into tuples.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union

PathLike = Union[str, "os.PathLike[str]"]

_ALOE_FIELDS = frozenset(
    {
        "prompt",
        "target_new",
        "subject",
        "ground_truth",
        "rephrases",
        "locality",
        "portability",
        "generation_prompts",
        "id",
        "relation",
        "source",
    }
)


def fact_statement(prompt: str, target: str) -> str:
    """An edit's new fact as a sentence: its request followed by its target ("The Eiffel Tower is
    located in the city of Rome."), as a conversation or a retrieved passage would mention it."""
    return f"{prompt.strip()} {target.strip()}."


class EditDataError(ValueError):
    """An edit file cannot be read: missing, not JSON, an unknown layout, or a bad record.

    The message names the file and, where it applies, the record (index and id),
    the JSONL line and the offending field.
    """


# ---------------------------------------------------------------------------
# Data classes
# ---------------------------------------------------------------------------


def normalize_answers(value: Any) -> tuple[str, ...] | None:
    """Flatten an answer field into a tuple of unique, stripped, non-empty strings.

    Accepts ``None``, a string, or (nested) lists/tuples of strings, e.g. KnowEdit's
    ``[["Soviet Union", "USSR"], ["Russia"]]``. Order of first appearance is kept.
    Returns ``None`` when nothing is left.

    Raises:
        TypeError: for anything that is not a string or a sequence of them.
    """
    if value is None:
        return None
    out: list[str] = []
    seen: set[str] = set()

    def visit(v: Any) -> None:
        if isinstance(v, str):
            s = v.strip()
            if s and s not in seen:
                seen.add(s)
                out.append(s)
        elif isinstance(v, (list, tuple)):
            for item in v:
                visit(item)
        elif v is None:
            return
        else:
            raise TypeError(f"an answer must be a string or a list of strings, got {type(v).__name__}: {v!r}")

    visit(value)
    return tuple(out) if out else None


def _str_tuple(value: Any, name: str) -> tuple[str, ...]:
    """A string or a sequence of strings -> tuple of stripped non-empty strings."""
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a list of strings, got {type(value).__name__}")
    out = []
    for v in value:
        if not isinstance(v, str):
            raise TypeError(f"{name} must contain strings, got {type(v).__name__}: {v!r}")
        if v.strip():
            out.append(v.strip())
    return tuple(out)


@dataclass(frozen=True)
class _PromptWithAnswers:
    """A prompt with optional accepted answers and the kind of probe it is (shared by
    :class:`LocalityPrompt` and :class:`PortabilityPrompt`)."""

    prompt: str
    ground_truth: tuple[str, ...] | None = None
    kind: str = ""
    _entry = "prompt"  # how error messages name an entry

    def __post_init__(self) -> None:
        if not isinstance(self.prompt, str) or not self.prompt.strip():
            raise ValueError(f"{type(self).__name__}.prompt must be a non-empty string, got {self.prompt!r}")
        object.__setattr__(self, "prompt", self.prompt.strip())
        object.__setattr__(self, "ground_truth", normalize_answers(self.ground_truth))

    @classmethod
    def from_obj(cls, obj: Any, default_kind: str | None = None):
        """Build from an instance, a bare prompt string, or ``{prompt, ground_truth, kind}``."""
        kind = default_kind or cls.__dataclass_fields__["kind"].default
        if isinstance(obj, cls):
            return obj
        if isinstance(obj, str):
            return cls(obj, None, kind)
        if isinstance(obj, Mapping):
            if "prompt" not in obj:
                raise ValueError(f"a {cls._entry} entry needs a 'prompt', got fields {sorted(obj)}")
            return cls(obj["prompt"], obj.get("ground_truth"), obj.get("kind") or kind)
        raise TypeError(f"a {cls._entry} entry must be a string or an object, got {type(obj).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready ``{prompt, ground_truth, kind}``."""
        return {
            "prompt": self.prompt,
            "ground_truth": list(self.ground_truth) if self.ground_truth is not None else None,
            "kind": self.kind,
        }


@dataclass(frozen=True)
class LocalityPrompt(_PromptWithAnswers):
    """A prompt whose answer the edit must leave unchanged.

    Attributes:
        prompt: the full prompt text.
        ground_truth: accepted answers (flattened, unique), or ``None`` when the
            dataset gives none (then compare against the unedited model).
        kind: where it came from: ``"neighborhood"``, ``"attribute"``,
            ``"relation_specificity"``, ``"forgetfulness"``, ``"nq"``, ...
    """

    kind: str = "neighborhood"
    _entry = "locality"


@dataclass(frozen=True)
class PortabilityPrompt(_PromptWithAnswers):
    """A prompt whose answer should follow from the edit (multi-hop, alias, inverse relation).

    Attributes:
        prompt: the full prompt text.
        ground_truth: accepted answers after the edit (flattened, unique).
        kind: ``"reasoning"``, ``"subject_aliasing"``, ``"logical_generalization"``, ...
    """

    kind: str = "portability"
    _entry = "portability"


@dataclass(frozen=True)
class EditRequest:
    """One fact to write into the model: ``prompt`` should continue with ``target_new``.

    Attributes:
        prompt: the full request text, subject included (ROME ``"{}"`` templates
            are filled in by the loader), e.g. ``"The Eiffel Tower is located in the city of"``.
        target_new: the new answer, stripped, WITHOUT a leading space (``"Rome"``).
            Scorers that compare generation targets add the leading space
            themselves (``" " + target_new``).
        subject: the entity the fact is about; normally a substring of ``prompt``.
        ground_truth: accepted aliases of the old answer, flattened into a tuple of
            unique strings (strings, lists and lists of lists are accepted), or
            ``None`` when unknown.
        rephrases: paraphrases of ``prompt`` that should also give ``target_new``.
        locality: prompts whose answers must not change.
        portability: prompts whose answers should follow from the edit.
        generation_prompts: open-ended prompts about the subject (ROME CounterFact).
        id: a unique id (``str(case_id)`` or ``"<file stem>-<index>"`` from the loader).
        relation: the Wikidata relation id (``"P36"``) when the data has it, else ``None``.
        source: the name of the format the record was parsed from (see :data:`FORMATS`).

    Lists given for the tuple fields are converted; locality/portability entries may
    be given as strings or ``{prompt, ground_truth, kind}`` mappings.

    Raises:
        ValueError: when ``prompt`` or ``target_new`` is not a non-empty string
            (the message names the field).
    """

    prompt: str
    target_new: str
    subject: str
    ground_truth: tuple[str, ...] | None = None
    rephrases: tuple[str, ...] = ()
    locality: tuple[LocalityPrompt, ...] = ()
    portability: tuple[PortabilityPrompt, ...] = ()
    generation_prompts: tuple[str, ...] = ()
    id: str | None = None
    relation: str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        for name in ("prompt", "target_new"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"EditRequest.{name} must be a non-empty string, got {value!r}")
            object.__setattr__(self, name, value.strip())
        if not isinstance(self.subject, str):
            raise ValueError(f"EditRequest.subject must be a string, got {self.subject!r}")
        object.__setattr__(self, "subject", self.subject.strip())
        object.__setattr__(self, "ground_truth", normalize_answers(self.ground_truth))
        object.__setattr__(self, "rephrases", _str_tuple(self.rephrases, "rephrases"))
        object.__setattr__(self, "generation_prompts", _str_tuple(self.generation_prompts, "generation_prompts"))
        loc = (self.locality,) if isinstance(self.locality, (str, Mapping, LocalityPrompt)) else self.locality
        object.__setattr__(self, "locality", tuple(LocalityPrompt.from_obj(x) for x in (loc or ())))
        por = (self.portability,) if isinstance(self.portability, (str, Mapping, PortabilityPrompt)) else self.portability
        object.__setattr__(self, "portability", tuple(PortabilityPrompt.from_obj(x) for x in (por or ())))
        for name in ("id", "relation", "source"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                object.__setattr__(self, name, str(value))

    @property
    def request_text(self) -> str:
        """The text the model is prompted with (the prompt, subject substituted)."""
        return self.prompt

    @property
    def template(self) -> str | None:
        """``prompt`` with the first occurrence of ``subject`` replaced by ``"{}"``, or
        ``None`` when the subject is empty or not in the prompt.

        Fill it with ``template.replace("{}", subject)`` (not ``str.format``: prompts
        may contain other braces)."""
        if not self.subject or self.subject not in self.prompt:
            return None
        return self.prompt.replace(self.subject, "{}", 1)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written by :func:`save_edits_jsonl` (empty optional fields left out)."""
        d: dict[str, Any] = {}
        if self.id is not None:
            d["id"] = self.id
        d["prompt"] = self.prompt
        d["target_new"] = self.target_new
        d["subject"] = self.subject
        if self.ground_truth is not None:
            d["ground_truth"] = list(self.ground_truth)
        if self.rephrases:
            d["rephrases"] = list(self.rephrases)
        if self.locality:
            d["locality"] = [x.to_dict() for x in self.locality]
        if self.portability:
            d["portability"] = [x.to_dict() for x in self.portability]
        if self.generation_prompts:
            d["generation_prompts"] = list(self.generation_prompts)
        if self.relation is not None:
            d["relation"] = self.relation
        if self.source is not None:
            d["source"] = self.source
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EditRequest:
        """Inverse of :meth:`to_dict` (unknown keys are rejected with a ``ValueError``)."""
        unknown = sorted(set(d) - _ALOE_FIELDS)
        if unknown:
            raise ValueError(f"unknown field(s) {unknown}; allowed: {sorted(_ALOE_FIELDS)}")
        return cls(**dict(d))
