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


@dataclass(frozen=True)
class SamePrompt:
    """Which slots share their prompt: a slot's negatives leave out the anchors of slots with its
    prompt (conflicting targets). Held as one id per distinct prompt, not as the (n, n) matrix, which
    would take 10 GB at 100,000 slots; ``row_ids`` are the ids of the slots asked about (all of them,
    or the rows taken by indexing: a chunk, a distributed build's share)."""

    ids: torch.Tensor
    row_ids: torch.Tensor

    @classmethod
    def of(cls, items: Sequence[Any]) -> SamePrompt:
        """From anything with a ``prompt``, one id per distinct prompt (comparing every pair of
        strings in Python takes most of a minute at 8,000 slots)."""
        known: dict[str, int] = {}
        ids = torch.tensor([known.setdefault(x.prompt, len(known)) for x in items], dtype=torch.long)
        return cls(ids, ids)

    def __getitem__(self, rows: torch.Tensor | slice) -> SamePrompt:
        return SamePrompt(self.ids, self.row_ids[rows])

    def against(self, slots: torch.Tensor) -> torch.Tensor:
        """(rows, len(slots)) bool: whether each row's slot shares its prompt with each of ``slots``."""
        return self.row_ids[:, None] == self.ids[slots][None, :]

    def matrix(self) -> torch.Tensor:
        """(rows, n) bool: the rows against every slot."""
        return self.row_ids[:, None] == self.ids[None, :]

    def to(self, device: torch.device | str) -> SamePrompt:
        return SamePrompt(self.ids.to(device), self.row_ids.to(device))
