"""Slots: one address per distinct (prompt, target) of the edit requests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

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


def same_prompt_matrix(items: Sequence[Any]) -> torch.Tensor:
    """(n, n) bool: whether items i and j (anything with a ``prompt``) share their prompt. A
    slot's negatives leave out the anchors of slots with its prompt (conflicting targets). Built
    from one id per distinct prompt: comparing every pair of strings in Python takes most of a
    minute at 8,000 slots."""
    ids: dict[str, int] = {}
    code = torch.tensor([ids.setdefault(x.prompt, len(ids)) for x in items], dtype=torch.long)
    return code[:, None] == code[None, :]
