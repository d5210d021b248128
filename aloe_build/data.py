"""Edit requests and the loaders of the standard knowledge-editing datasets.

Everything downstream (construction, evaluation, the command line) works on
:class:`EditRequest`; :func:`load_edits` turns a benchmark file into a list of
them, whatever the benchmark's layout. Formats recognised (the name is what
:func:`detect_format` returns and what ends up in ``EditRequest.source``):

================================  ==========================================================
``counterfact_rome``              original ROME CounterFact: ``requested_rewrite{prompt with
                                  "{}", relation_id, subject, target_new{str},
                                  target_true{str}}``, ``paraphrase_prompts``,
                                  ``neighborhood_prompts``, ``attribute_prompts``,
                                  ``generation_prompts``
``counterfact_easyedit``          EasyEdit CounterFact (also EasyEdit's flat ZsRE): ``case_id``,
                                  ``prompt``, ``subject``, ``target_new``, ``ground_truth``,
                                  ``rephrase_prompt``, ``locality_prompt``,
                                  ``locality_ground_truth``
``zsre_mend``                     MEND zsRE: ``subject``, ``src``, ``alt``, ``answers``,
                                  ``rephrase``, ``loc`` ("nq question: ..."), ``loc_ans``
``knowedit_zsre``                 KnowEdit ZsRE: ``subject``, ``prompt``, ``target_new``,
                                  ``ground_truth`` (list), ``rephrase_prompt``,
                                  ``locality{...}``, ``portability{...}``
``knowedit_wikidata_counterfact`` KnowEdit WikiData_counterfact (``train_cf.json``): as above
                                  with a string ``ground_truth`` and no rephrase
``knowedit_wikidata_recent``      KnowEdit WikiData_recent (``recent_train.json``): no
                                  ``ground_truth`` (the fact is new)
``knowedit_wikibio``              KnowEdit WikiBio: ``text``, ``labels``, ``concept``,
                                  ``locality{...}``
``aloe_jsonl``                    our own format, one object per line with the
                                  :class:`EditRequest` field names (see
                                  :func:`save_edits_jsonl`)
================================  ==========================================================

Decisions worth knowing:

* ``prompt`` is always the full request text. ROME templates carry ``"{}"`` for
  the subject; it is substituted at load time.
* ``target_new`` (and every ground truth) is stored stripped, without a leading
  space. Whoever scores a generation target adds the leading space itself
  (``" " + target_new``), as the standard CounterFact/zsRE evaluations do.
* Ground truths arrive as strings, lists, or lists of lists (KnowEdit alias
  lists); they are flattened into one tuple of unique, non-empty strings in
  order of first appearance (``None`` when nothing is left).
* zsRE ``loc`` prompts are Natural Questions prompts of the form
  ``"nq question: who plays ..."``; the ``"nq question: "`` prefix is removed and
  the question is kept verbatim (lower-case, no question mark added), with
  ``kind="nq"`` so that evaluations can still tell them apart.
* ROME CounterFact: ``neighborhood_prompts`` become locality prompts of kind
  ``"neighborhood"`` (ground truth: the true object), ``attribute_prompts``
  become locality prompts of kind ``"attribute"`` (other subjects whose true
  object is the new target, so their ground truth is ``target_new``), and
  ``alternative_subject`` becomes a ``"subject_aliasing"`` portability prompt.
  Filter on ``kind`` to reproduce the classic neighbourhood score.
* KnowEdit ``locality``/``portability`` keys are lower-cased into ``kind``
  (``"relation_specificity"``, ``"forgetfulness"``, ``"reasoning"``,
  ``"subject_aliasing"``, ``"logical_generalization"``).
* WikiBio: ``prompt`` = ``text`` (the passage), ``target_new`` = ``labels`` (the
  sentence to append), ``subject`` = ``concept``; no ground truth.
* ids: ``str(case_id)`` when the record has one, else ``f"{file stem}-{index}"``
  (index of the record in the file, 0-based). Duplicate ids are an error.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

__all__ = [
    "FORMATS",
    "EditDataError",
    "EditRequest",
    "LocalityPrompt",
    "PortabilityPrompt",
    "detect_format",
    "load_edits",
    "normalize_answers",
    "relation_templates",
    "save_edits_jsonl",
]

PathLike = Union[str, "os.PathLike[str]"]

#: Every format name :func:`detect_format` can return.
FORMATS: tuple[str, ...] = (
    "counterfact_rome",
    "counterfact_easyedit",
    "zsre_mend",
    "knowedit_zsre",
    "knowedit_wikidata_counterfact",
    "knowedit_wikidata_recent",
    "knowedit_wikibio",
    "aloe_jsonl",
)

# What each format is recognised by (used in the "unrecognised format" message).
_EXPECTED_FIELDS: dict[str, str] = {
    "counterfact_rome": "requested_rewrite{prompt, subject, target_new{str}, target_true{str}}, "
    "paraphrase_prompts, neighborhood_prompts",
    "counterfact_easyedit": "prompt, subject, target_new, ground_truth, rephrase_prompt, "
    "locality_prompt, locality_ground_truth",
    "zsre_mend": "subject, src, alt, answers, rephrase, loc, loc_ans",
    "knowedit_*": "subject, prompt, target_new, locality{...} and/or portability{...} "
    "(+ ground_truth, rephrase_prompt)",
    "knowedit_wikibio": "text, labels, concept, locality{...}",
    "aloe_jsonl": "prompt, target_new, subject (+ ground_truth, rephrases, locality, "
    "portability, generation_prompts, id, relation, source)",
}

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

_NQ_PREFIX = "nq question: "


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
        por = (
            (self.portability,)
            if isinstance(self.portability, (str, Mapping, PortabilityPrompt))
            else self.portability
        )
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


# ---------------------------------------------------------------------------
# Reading files
# ---------------------------------------------------------------------------


def _read_records(path: Path) -> Iterator[tuple[Any, int | None]]:
    """Yield (raw record, JSONL line number or None) from a JSON or JSONL file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EditDataError(f"{path}: edit file not found") from None
    except IsADirectoryError:
        raise EditDataError(f"{path}: is a directory, expected a .json or .jsonl edit file") from None
    except UnicodeDecodeError as e:
        raise EditDataError(f"{path}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise EditDataError(f"{path}: cannot read ({e})") from None

    is_jsonl = path.suffix.lower() in (".jsonl", ".ndjson")
    if not is_jsonl:
        try:
            data = json.loads(text) if text.strip() else []
        except json.JSONDecodeError as e:
            # A .json file that is really JSON Lines (several objects, one per line)?
            first = text.lstrip().splitlines()[0] if text.strip() else ""
            if e.msg == "Extra data" and first.startswith("{"):
                is_jsonl = True
            else:
                raise EditDataError(
                    f"{path}: invalid JSON at line {e.lineno}, column {e.colno}: {e.msg}"
                ) from None
        if not is_jsonl:
            for rec in _unwrap(data, path):
                yield rec, None
            return

    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise EditDataError(f"{path}: line {lineno}: invalid JSON at column {e.colno}: {e.msg}") from None
        yield rec, lineno


def _unwrap(data: Any, path: Path) -> list[Any]:
    """The list of records in a parsed JSON document (a list, a dict wrapping one, or one record)."""
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        if _detect_one(data) is not None:  # a single record
            return [data]
        lists = {k: v for k, v in data.items() if isinstance(v, list) and (not v or isinstance(v[0], dict))}
        if len(lists) == 1:
            return next(iter(lists.values()))
        for key in ("data", "records", "edits", "requests"):
            if key in lists:
                return lists[key]
        if not lists:
            raise EditDataError(
                f"{path}: the top-level JSON object holds no list of records "
                f"(keys: {sorted(data)[:20]}); expected a list of edit records or an object wrapping one"
            )
        raise EditDataError(
            f"{path}: the top-level JSON object holds several lists of records {sorted(lists)}; "
            f"cannot tell which one holds the edits"
        )
    raise EditDataError(f"{path}: expected a JSON list of edit records, got a JSON {type(data).__name__}")


def _detect_one(rec: Mapping[str, Any]) -> str | None:
    """The format of one record, or None when it matches none."""
    keys = set(rec)
    if "requested_rewrite" in keys:
        return "counterfact_rome"
    if "src" in keys and ("alt" in keys or "loc" in keys):
        return "zsre_mend"
    if {"text", "labels", "concept"} <= keys:
        return "knowedit_wikibio"
    if "prompt" in keys and "target_new" in keys:
        if isinstance(rec.get("locality"), Mapping) or isinstance(rec.get("portability"), Mapping):
            if "rephrase_prompt" in keys:
                return "knowedit_zsre"
            if "ground_truth" in keys:
                return "knowedit_wikidata_counterfact"
            return "knowedit_wikidata_recent"
        if keys & {"rephrase_prompt", "locality_prompt", "locality_ground_truth", "case_id"}:
            return "counterfact_easyedit"
        if keys <= _ALOE_FIELDS:
            return "aloe_jsonl"
    return None


def detect_format(records: Sequence[Any]) -> str:
    """Name the dataset format of ``records`` (parsed JSON records) from the first one.

    Returns one of :data:`FORMATS`. An empty sequence is ``"aloe_jsonl"``.

    Raises:
        EditDataError: when the first record is not an object or matches no known
            format; the message lists the fields seen and those each format expects.
    """
    if len(records) == 0:
        return "aloe_jsonl"
    return _detect_record(records[0], "record 0")


def _detect_record(rec: Any, where: str) -> str:
    if not isinstance(rec, Mapping):
        raise EditDataError(f"{where}: expected a JSON object, got a JSON {type(rec).__name__}: {str(rec)[:80]}")
    fmt = _detect_one(rec)
    if fmt is None:
        expected = "; ".join(f"{k}: {v}" for k, v in _EXPECTED_FIELDS.items())
        raise EditDataError(
            f"{where}: unrecognised edit format; fields seen: {sorted(rec)}; expected one of: {expected}"
        )
    return fmt


class _Ctx:
    """Where a record came from, for error messages."""

    def __init__(self, path: Path, index: int, lineno: int | None, rec_id: str | None) -> None:
        self.path, self.index, self.lineno, self.rec_id = path, index, lineno, rec_id

    def __str__(self) -> str:
        s = f"{self.path}: record {self.index}"
        if self.lineno is not None:
            s += f" (line {self.lineno})"
        if self.rec_id is not None:
            s += f" [id {self.rec_id}]"
        return s

    def error(self, msg: str) -> EditDataError:
        return EditDataError(f"{self}: {msg}")


def _get(rec: Mapping[str, Any], key: str, ctx: _Ctx) -> Any:
    if key not in rec:
        raise ctx.error(f"missing required field '{key}' (fields seen: {sorted(rec)})")
    return rec[key]


def _req_str(
    rec: Mapping[str, Any], key: str, ctx: _Ctx, what: str | None = None, allow_empty: bool = False
) -> str:
    value = _get(rec, key, ctx)
    label = f"'{key}'" + (f" ({what})" if what else "")
    if not isinstance(value, str):
        raise ctx.error(f"field {label} must be a string, got {type(value).__name__}: {str(value)[:80]}")
    if not allow_empty and not value.strip():
        raise ctx.error(f"field {label} is empty")
    return value


def _opt_strs(rec: Mapping[str, Any], key: str, ctx: _Ctx) -> tuple[str, ...]:
    try:
        return _str_tuple(rec.get(key), key)
    except TypeError as e:
        raise ctx.error(str(e)) from None


def _answers(value: Any, ctx: _Ctx, key: str) -> tuple[str, ...] | None:
    try:
        return normalize_answers(value)
    except TypeError as e:
        raise ctx.error(f"field '{key}': {e}") from None


def _prompt_groups(value: Any, ctx: _Ctx, key: str, cls: type) -> list:
    """KnowEdit ``{"Relation_Specificity": [{prompt, ground_truth}, ...], ...}`` -> prompt objects."""
    if value is None:
        return []
    if not isinstance(value, Mapping):
        raise ctx.error(f"field '{key}' must be an object of lists, got {type(value).__name__}")
    out = []
    for group, entries in value.items():
        kind = str(group).strip().lower()
        if isinstance(entries, Mapping):
            entries = [entries]
        if not isinstance(entries, list):
            raise ctx.error(f"field '{key}.{group}' must be a list, got {type(entries).__name__}")
        for j, e in enumerate(entries):
            if isinstance(e, str):
                e = {"prompt": e}
            if not isinstance(e, Mapping) or "prompt" not in e:
                raise ctx.error(f"field '{key}.{group}[{j}]' must be an object with a 'prompt'")
            p = e["prompt"]
            if isinstance(p, list):  # some EasyEdit files wrap a single prompt in a list
                p = " ".join(x for x in p if isinstance(x, str))
            if not isinstance(p, str):
                raise ctx.error(f"field '{key}.{group}[{j}].prompt' must be a string")
            if not p.strip():
                continue
            out.append(cls(p, _answers(e.get("ground_truth"), ctx, f"{key}.{group}[{j}].ground_truth"), kind))
    return out


# --- one parser per format --------------------------------------------------


def _parse_rome(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    rw = _get(rec, "requested_rewrite", ctx)
    if not isinstance(rw, Mapping):
        raise ctx.error("field 'requested_rewrite' must be an object")
    template = _req_str(rw, "prompt", ctx, "requested_rewrite.prompt")
    subject = _req_str(rw, "subject", ctx, "requested_rewrite.subject")
    if "{}" not in template:
        raise ctx.error(f"field 'requested_rewrite.prompt' has no '{{}}' subject slot: {template!r}")

    def obj_str(key: str, required: bool) -> str | None:
        v = rw.get(key)
        if v is None:
            if required:
                raise ctx.error(f"missing required field 'requested_rewrite.{key}'")
            return None
        if isinstance(v, Mapping):
            v = v.get("str")
        if not isinstance(v, str) or (required and not v.strip()):
            raise ctx.error(f"field 'requested_rewrite.{key}.str' is missing or empty")
        return v

    target_new = obj_str("target_new", True)
    target_true = obj_str("target_true", False)
    assert target_new is not None
    loc = [LocalityPrompt(p, target_true, "neighborhood") for p in _opt_strs(rec, "neighborhood_prompts", ctx)]
    loc += [LocalityPrompt(p, target_new, "attribute") for p in _opt_strs(rec, "attribute_prompts", ctx)]
    port = []
    alt = rec.get("alternative_subject")
    if isinstance(alt, str) and alt.strip():
        port.append(PortabilityPrompt(template.replace("{}", alt.strip()), target_new, "subject_aliasing"))
    return EditRequest(
        prompt=template.replace("{}", subject),
        target_new=target_new,
        subject=subject,
        ground_truth=target_true,
        rephrases=_opt_strs(rec, "paraphrase_prompts", ctx),
        locality=tuple(loc),
        portability=tuple(port),
        generation_prompts=_opt_strs(rec, "generation_prompts", ctx),
        id=ctx.rec_id,
        relation=rw.get("relation_id") or None,
        source=fmt,
    )


def _parse_easyedit(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    loc = []
    lp = rec.get("locality_prompt")
    lps = [lp] if isinstance(lp, str) else (lp or [])
    lgt = rec.get("locality_ground_truth")
    for p in lps:
        if isinstance(p, str) and p.strip():
            loc.append(LocalityPrompt(p, _answers(lgt, ctx, "locality_ground_truth"), "neighborhood"))
    return EditRequest(
        prompt=_req_str(rec, "prompt", ctx),
        target_new=_req_str(rec, "target_new", ctx),
        subject=_req_str(rec, "subject", ctx),
        ground_truth=_answers(rec.get("ground_truth"), ctx, "ground_truth"),
        rephrases=_opt_strs(rec, "rephrase_prompt", ctx),
        locality=tuple(loc),
        portability=tuple(_prompt_groups(rec.get("portability"), ctx, "portability", PortabilityPrompt)),
        id=ctx.rec_id,
        relation=rec.get("relation_id") or None,
        source=fmt,
    )


def _parse_zsre(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    loc = []
    lq = rec.get("loc")
    if isinstance(lq, str) and lq.strip():
        q = lq[len(_NQ_PREFIX) :] if lq.startswith(_NQ_PREFIX) else lq
        if q.strip():
            loc.append(LocalityPrompt(q, _answers(rec.get("loc_ans"), ctx, "loc_ans"), "nq"))
    return EditRequest(
        prompt=_req_str(rec, "src", ctx, "prompt"),
        target_new=_req_str(rec, "alt", ctx, "target_new"),
        subject=_req_str(rec, "subject", ctx),
        ground_truth=_answers(rec.get("answers"), ctx, "answers"),
        rephrases=_opt_strs(rec, "rephrase", ctx),
        locality=tuple(loc),
        id=ctx.rec_id,
        source=fmt,
    )


def _parse_knowedit(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    return EditRequest(
        prompt=_req_str(rec, "prompt", ctx),
        target_new=_req_str(rec, "target_new", ctx),
        subject=_req_str(rec, "subject", ctx),
        ground_truth=_answers(rec.get("ground_truth"), ctx, "ground_truth"),
        rephrases=_opt_strs(rec, "rephrase_prompt", ctx),
        locality=tuple(_prompt_groups(rec.get("locality"), ctx, "locality", LocalityPrompt)),
        portability=tuple(_prompt_groups(rec.get("portability"), ctx, "portability", PortabilityPrompt)),
        id=ctx.rec_id,
        relation=rec.get("relation_id") or None,
        source=fmt,
    )


def _parse_wikibio(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    return EditRequest(
        prompt=_req_str(rec, "text", ctx, "prompt"),
        target_new=_req_str(rec, "labels", ctx, "target_new"),
        subject=_req_str(rec, "concept", ctx, "subject"),
        locality=tuple(_prompt_groups(rec.get("locality"), ctx, "locality", LocalityPrompt)),
        id=ctx.rec_id,
        source=fmt,
    )


def _parse_aloe(rec: Mapping[str, Any], ctx: _Ctx, fmt: str) -> EditRequest:
    unknown = sorted(set(rec) - _ALOE_FIELDS)
    if unknown:
        raise ctx.error(f"unknown field(s) {unknown} for the aloe_jsonl format; allowed: {sorted(_ALOE_FIELDS)}")
    prompt = _req_str(rec, "prompt", ctx)
    target = _req_str(rec, "target_new", ctx)
    subject = _req_str(rec, "subject", ctx, allow_empty=True)
    try:
        loc = tuple(LocalityPrompt.from_obj(x) for x in _as_list(rec.get("locality")))
        port = tuple(PortabilityPrompt.from_obj(x) for x in _as_list(rec.get("portability")))
    except (TypeError, ValueError) as e:
        raise ctx.error(str(e)) from None
    source = rec.get("source")
    return EditRequest(
        prompt=prompt,
        target_new=target,
        subject=subject,
        ground_truth=_answers(rec.get("ground_truth"), ctx, "ground_truth"),
        rephrases=_opt_strs(rec, "rephrases", ctx),
        locality=loc,
        portability=port,
        generation_prompts=_opt_strs(rec, "generation_prompts", ctx),
        id=ctx.rec_id,
        relation=rec.get("relation") or None,
        source=source if isinstance(source, str) and source else fmt,
    )


def _as_list(v: Any) -> list:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return list(v)
    return [v]


_PARSERS = {
    "counterfact_rome": _parse_rome,
    "counterfact_easyedit": _parse_easyedit,
    "zsre_mend": _parse_zsre,
    "knowedit_zsre": _parse_knowedit,
    "knowedit_wikidata_counterfact": _parse_knowedit,
    "knowedit_wikidata_recent": _parse_knowedit,
    "knowedit_wikibio": _parse_wikibio,
    "aloe_jsonl": _parse_aloe,
}


def _record_id(rec: Mapping[str, Any], fmt: str, stem: str, index: int) -> str:
    key = "id" if fmt == "aloe_jsonl" else "case_id"
    v = rec.get(key)
    if v is None and fmt != "aloe_jsonl":
        v = rec.get("id")
    if v is None or (isinstance(v, str) and not v.strip()):
        return f"{stem}-{index}"
    return str(v).strip()


def load_edits(path: PathLike, limit: int | None = None, *, skip_invalid: bool = False) -> list[EditRequest]:
    """Load edit requests from a benchmark file, detecting its format.

    Args:
        path: a ``.json`` file (a list of records, or an object wrapping one) or a
            ``.jsonl`` file (one record per line) in any of :data:`FORMATS`.
        limit: return at most the first ``limit`` edits (``None``: all). Records
            after that are not parsed.
        skip_invalid: drop records that fail validation (missing field, empty
            target, duplicate id) with one warning, instead of raising. Some
            published files have such records (e.g. two zsRE MEND records with an
            empty ``alt``). With ``limit``, the first ``limit`` valid edits are returned.

    Returns:
        The edits, in file order, each with ``source`` set to the format name
        (JSONL written by :func:`save_edits_jsonl` keeps the original ``source``).

    Raises:
        EditDataError: the file is missing or unreadable, is not valid JSON (the
            JSONL line is named), has an unrecognised format (the record and the
            fields seen vs expected are named), or a record is missing a required
            field or has an empty target (the record index, id and field are named).
        ValueError: ``limit`` is negative.
    """
    if limit is not None and (not isinstance(limit, int) or limit < 0):
        raise ValueError(f"limit must be a non-negative integer or None, got {limit!r}")
    p = Path(path)
    stem = p.stem
    out: list[EditRequest] = []
    if limit == 0:
        if not p.is_file():
            raise EditDataError(f"{p}: edit file not found")
        return out
    fmt: str | None = None
    seen_ids: dict[str, int] = {}
    skipped: list[str] = []
    for index, (rec, lineno) in enumerate(_read_records(p)):
        where = f"{p}: record {index}" + (f" (line {lineno})" if lineno is not None else "")
        if fmt is None:
            fmt = _detect_record(rec, where)
        elif not isinstance(rec, Mapping):
            err = EditDataError(f"{where}: expected a JSON object, got a JSON {type(rec).__name__}")
            if not skip_invalid:
                raise err
            skipped.append(str(err))
            continue
        try:
            rec_id = _record_id(rec, fmt, stem, index)
            ctx = _Ctx(p, index, lineno, rec_id)
            if rec_id in seen_ids:
                raise ctx.error(f"duplicate id {rec_id!r} (first used by record {seen_ids[rec_id]})")
            try:
                edit = _PARSERS[fmt](rec, ctx, fmt)
            except EditDataError:
                raise
            except (TypeError, ValueError) as e:
                raise ctx.error(str(e)) from None
        except EditDataError as e:
            if not skip_invalid:
                raise EditDataError(
                    f"{e} (format {fmt}; pass skip_invalid=True to drop invalid records)"
                ) from None
            skipped.append(str(e))
            continue
        seen_ids[rec_id] = index
        out.append(edit)
        if limit is not None and len(out) >= limit:
            break
    if skipped:
        more = f" (and {len(skipped) - 3} more)" if len(skipped) > 3 else ""
        warnings.warn(
            f"{p}: skipped {len(skipped)} invalid record(s): " + "; ".join(skipped[:3]) + more,
            stacklevel=2,
        )
    return out


def save_edits_jsonl(requests: Iterable[EditRequest], path: PathLike) -> Path:
    """Write edits as our own JSONL format (one :meth:`EditRequest.to_dict` object per line).

    The file round-trips through :func:`load_edits`: the edits compare equal, provided
    each has an ``id`` and a ``source`` (on reload an edit without an id gets
    ``"<file stem>-<index>"``, and one without a source gets ``"aloe_jsonl"``).
    Parent folders are created. Returns the path written.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for r in requests:
            if not isinstance(r, EditRequest):
                raise TypeError(f"save_edits_jsonl expects EditRequest objects, got {type(r).__name__}")
            f.write(json.dumps(r.to_dict(), ensure_ascii=False) + "\n")
    os.replace(tmp, p)
    return p


def relation_templates(requests: Iterable[EditRequest]) -> dict[str, list[str]]:
    """Mine prompt templates (subject replaced by ``"{}"``) from edit requests, grouped by relation.

    Requests with a ``relation`` (e.g. ``"P101"``) are grouped by it. Without one
    (EasyEdit's CounterFact), templates are linked into relations through each
    record's own data: its rephrases end with another template of the same
    relation filled with the same subject, and its locality prompts are a
    template of the same relation filled with another subject; linked templates
    form one group, keyed by its first template. Requests whose subject does not
    occur in the prompt are skipped; each group lists unique templates in order
    of first appearance. Used to build same-subject prompts of other relations
    (negatives) and of the same relation (paraphrase positives): fill a template
    with ``template.replace("{}", subject)``.
    """
    reqs = [r for r in requests if r.template is not None]
    order = list(dict.fromkeys(r.template for r in reqs))
    if any(r.relation for r in reqs):
        groups: dict[str, list[str]] = {}
        for r in reqs:
            members = groups.setdefault(r.relation or r.template, [])
            if r.template not in members:
                members.append(r.template)
        return groups
    parent = {t: t for t in order}  # union-find over templates
    matcher = _TemplateMatcher(order)
    for r in reqs:
        linked = [matcher.filled(q, r.subject) for q in r.rephrases]
        linked += [matcher.other_subject(loc.prompt) for loc in r.locality]
        for t in linked:
            if t is not None:
                ra, rb = _find(parent, r.template), _find(parent, t)
                parent[rb] = ra
    by_root: dict[str, list[str]] = {}
    for t in order:
        by_root.setdefault(_find(parent, t), []).append(t)
    return {members[0]: members for members in by_root.values()}


def _find(parent: dict[str, str], x: str) -> str:
    while parent[x] != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


class _TemplateMatcher:
    """Which known template a prompt instantiates (the one with the most fixed text wins)."""

    def __init__(self, templates: Sequence[str]):
        self.templates = sorted(templates, key=lambda t: -len(t.replace("{}", "")))

    def filled(self, prompt: str, subject: str) -> str | None:
        """A template that, filled with ``subject``, ends ``prompt`` (rephrases carry a lead-in sentence)."""
        return next((t for t in self.templates if prompt.endswith(t.replace("{}", subject, 1))), None)

    def other_subject(self, prompt: str) -> str | None:
        """A template that ``prompt`` fills with some single-sentence subject."""
        for t in self.templates:
            head, tail = t.split("{}", 1)
            if len(prompt) > len(head) + len(tail) and prompt.startswith(head) and prompt.endswith(tail):
                middle = prompt[len(head): len(prompt) - len(tail)]
                if "." not in middle and "?" not in middle:
                    return t
        return None
