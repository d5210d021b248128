"""Slots: one address per distinct (prompt, target) of the edit requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .data import EditRequest


@dataclass
class Slot:
    """One address: edits with identical (prompt, target) share it."""

    prompt: str
    target: str
    subject: str
    ids: list[str]
    relation: str | None
    template: str | None  # the request with its subject replaced by "{}" (EditRequest.template)


def make_slots(requests: Sequence[EditRequest]) -> list[Slot]:
    """The slots of ``requests`` in order of first appearance; an edit without an id is ``edit-<index>``."""
    slots: dict[tuple[str, str], Slot] = {}
    for i, r in enumerate(requests):
        key = (r.prompt, r.target_new)
        rid = r.id if r.id is not None else f"edit-{i}"
        if key in slots:
            slots[key].ids.append(rid)
        else:
            slots[key] = Slot(r.prompt, r.target_new, r.subject, [rid], r.relation, r.template)
    return list(slots.values())
