"""Change the facts of a built operator without rebuilding it: append, remove and update edits.

``append_edits`` builds slots only for the new requests, against the existing
operator (:class:`aloe_build.pipeline.AppendBase`): the old slots' anchor
states are negatives of the new slots; the old slots that would open on the new
anchors or continuation negatives, below their own worst anchor, are recalibrated (stage 5's
closed form, from the worst anchor and worst negative scores kept in the build state; see
``addresses.recalibrate`` for a new state above an old slot's worst anchor); the new writes are
fitted with the old edits patched into the model, their writes fixed, so a new
write corrects for an old gate only where the two overlap. Nothing of the old
slots is recomputed: what an append needs of them is the build state
(:mod:`aloe_build.build_state`) beside the operator.

``remove_edits`` drops edits by id (a slot shared by several ids stays while
one of them is left); ``update_edits`` removes the edits a corrected request
replaces (same id, or same prompt) and appends the corrected ones.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from aloe_kernels import AloeOperator

from .build_state import BuildState
from .chat_slots import entry_id, is_chat_entry
from .config import BuildConfig
from .data import EditRequest
from .pipeline import AppendBase, BuildError, _Build

__all__ = ["AppendPlan", "append_edits", "load_with_state", "plan_append", "remove_edits", "save_with_state", "update_edits"]


@dataclass
class AppendPlan:
    """How requests relate to an operator: new ones, ones it already holds, conflicting ones."""

    new: list[EditRequest] = field(default_factory=list)
    already_present: list[EditRequest] = field(default_factory=list)
    conflicts: list[tuple[EditRequest, str]] = field(default_factory=list)  # (request, id of the edit it conflicts with)


def load_with_state(path: str | os.PathLike) -> tuple[AloeOperator, BuildState]:
    """An artifact directory's operator and its build state, both validated."""
    op = AloeOperator.load(path)
    return op, BuildState.load(path, op)


def plan_append(op: AloeOperator, requests: Sequence[EditRequest]) -> AppendPlan:
    """Sort ``requests`` against ``op``: the same (prompt, target) is already present; the same prompt
    with another target, or an id the operator already uses, is a conflict; the rest is new."""
    by_prompt = {str(e.get("request")): e for e in op.edits if not is_chat_entry(e)}
    used_ids = {str(i) for e in op.edits for i in [e.get("id"), *(e.get("ids") or [])] if i is not None}
    plan = AppendPlan()
    for r in requests:
        old = by_prompt.get(r.prompt)
        if old is not None and str(old.get("target")) == r.target_new:
            plan.already_present.append(r)
        elif old is not None:
            plan.conflicts.append((r, str(old.get("id"))))
        elif r.id is not None and str(r.id) in used_ids:
            plan.conflicts.append((r, str(r.id)))
        else:
            plan.new.append(r)
    return plan


def _with_ids(requests: Sequence[EditRequest], used: set[str]) -> list[EditRequest]:
    """Requests without an id get ``edit-<k>`` with k past every id in use (ids stay unique in the merge)."""
    out, k = [], len(used)
    for r in requests:
        if r.id is None:
            while f"edit-{k}" in used:
                k += 1
            r = dataclasses.replace(r, id=f"edit-{k}")
            used.add(r.id)
        out.append(r)
    return out


def append_edits(
    model,
    tokenizer,
    operator: AloeOperator | str | os.PathLike,
    requests: Sequence[EditRequest],
    config: BuildConfig | None = None,
    out_dir: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = print,
    state: BuildState | None = None,
) -> AloeOperator:
    """Add ``requests`` to ``operator`` (an artifact directory, or an operator with its ``state``).

    Requests the operator already holds are reported and skipped; one whose prompt the operator
    holds with another target, or whose id it uses, is refused (:func:`update_edits` corrects a
    fact). ``config`` defaults to the one the operator was built with. With ``out_dir`` the stages
    checkpoint there and the build state of the result is written beside it; the caller saves the
    operator (``op.save(out_dir)``), as after :func:`build_operator`.
    """
    say = log or (lambda _msg: None)
    op, state = _base(operator, state)
    plan = plan_append(op, requests)
    if plan.conflicts:
        shown = "; ".join(f"{r.prompt!r} -> {r.target_new!r} (edit {eid})" for r, eid in plan.conflicts[:5])
        raise BuildError(
            f"{len(plan.conflicts)} request(s) conflict with edits the operator holds (same prompt "
            f"with another target, or an id in use): {shown}. Use update_edits (`aloe update`) to "
            "correct a fact"
        )
    if plan.already_present:
        say(
            f"{len(plan.already_present)} request(s) already in the operator, not added again: "
            + ", ".join(repr(r.prompt) for r in plan.already_present[:5])
        )
    if not plan.new:
        say("nothing new to append")
        return op
    cfg = config or BuildConfig.from_dict(state.config)
    if cfg.layer is not None and op.layer is not None and cfg.layer != op.layer:
        raise BuildError(f"the operator edits layer {op.layer}; config.layer is {cfg.layer}")
    if cfg.reading_decay != op.reading_decay:
        raise BuildError(f"the operator's gates read with decay {op.reading_decay}; config.reading_decay is {cfg.reading_decay}")
    cfg = BuildConfig.from_dict({**cfg.to_dict(), "layer": op.layer})
    used = {str(i) for e in op.edits for i in [e.get("id"), *(e.get("ids") or [])] if i is not None}
    new = _with_ids(plan.new, used)
    say(f"appending {len(new)} edit(s) to an operator of {op.n}")
    return _Build(model, tokenizer, new, cfg, out_dir, log, base=AppendBase(op, state)).run()


def _base(operator: AloeOperator | str | os.PathLike, state: BuildState | None) -> tuple[AloeOperator, BuildState]:
    if isinstance(operator, AloeOperator):
        if state is None:
            raise BuildError("append_edits: pass the operator's build state (state=), or its artifact directory")
        state.check(operator)
        return operator, state
    return load_with_state(operator)


def remove_edits(op: AloeOperator, state: BuildState, ids: Sequence[str]) -> tuple[AloeOperator, BuildState]:
    """``op`` and ``state`` without the edits ``ids``; unknown ids raise :class:`BuildError`.

    A slot shared by several identical edits loses the id only, and stays while one is left. Other
    slots are untouched: they stay shut on the removed edit's states, so its prompt gets the
    unedited answer again."""
    drop = {str(i) for i in ids}
    known = {str(i) for e in op.edits for i in [e.get("id"), *(e.get("ids") or [])] if i is not None}
    unknown = sorted(drop - known)
    if unknown:
        raise BuildError(f"remove: the operator holds no edit with id {', '.join(map(repr, unknown))}")
    keep, edits = [], []
    for row, e in enumerate(op.edits):
        slot_ids = [str(i) for i in (e.get("ids") or [e.get("id")])]
        left = [i for i in slot_ids if i not in drop]
        if left:
            keep.append(row)
            edits.append({**e, "id": entry_id(left, e), "ids": left})
    kept = op.select(keep)
    kept.edits = edits
    return kept, state.select(keep)


def update_edits(
    model,
    tokenizer,
    operator_dir: str | os.PathLike,
    requests: Sequence[EditRequest],
    config: BuildConfig | None = None,
    out_dir: str | os.PathLike | None = None,
    log: Callable[[str], None] | None = print,
) -> AloeOperator:
    """Correct facts: every edit a request replaces (same id, or same prompt) is removed, then the
    requests are appended. Requests the operator already holds unchanged are reported and skipped."""
    op, state = load_with_state(operator_dir)
    plan = plan_append(op, requests)
    replaced = sorted({eid for _r, eid in plan.conflicts})
    if replaced:
        (log or (lambda _m: None))(f"replacing {len(replaced)} edit(s): {', '.join(replaced[:10])}")
        op, state = remove_edits(op, state, _slot_ids(op, replaced))
    return append_edits(model, tokenizer, op, requests, config, out_dir, log, state=state)


def _slot_ids(op: AloeOperator, ids: Sequence[str]) -> list[str]:
    """Every id of the slots that hold ``ids`` (a corrected fact replaces its whole slot)."""
    want, out = set(ids), []
    for e in op.edits:
        slot_ids = [str(i) for i in (e.get("ids") or [e.get("id")])]
        if want & set(slot_ids):
            out += slot_ids
    return out


def save_with_state(op: AloeOperator, state: BuildState, out: str | os.PathLike) -> Path:
    """Write an operator and its build state into ``out`` (the artifact of remove/update)."""
    path = op.save(out)
    state.save(path, op)
    return path
