"""Chat slots (``BuildConfig.chat.chat_slots``): each edit's chat forms get a slot of their own.

A build with chat positives anchors one slot on the request and on its chat forms. A gate widened
for rewordings (``calibration_open_at`` < 1) then also opens wider at the chat template's assistant
header, a position every conversation passes. With chat slots, slot ``n + i`` holds the chat forms
of slot ``i`` (the operator's ``n`` request slots come first): the request's slot keeps the request
and its prefixed forms, and the chat slot is always calibrated at its worst anchor.

In the operator's metadata a chat slot carries its edit's ids under ``"ids"``, its own ``"id"``
(the first id with :data:`CHAT_ID_SUFFIX`) and ``"form": "chat"``, so that removing an edit removes
both of its slots and the evaluation finds the slot a chat request is addressed to.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from .config import BuildConfig

CHAT_FORM = "chat"
#: Appended to an edit's id to name its chat slot (operator ids must be unique).
CHAT_ID_SUFFIX = "#chat"


def is_chat_entry(entry: Mapping[str, Any]) -> bool:
    """Whether an operator metadata entry is a chat slot."""
    return entry.get("form") == CHAT_FORM


def chat_id(edit_id: Any) -> str:
    """The id of the chat slot of the edit ``edit_id``."""
    return f"{edit_id}{CHAT_ID_SUFFIX}"


def entry_id(ids: Sequence[str], entry: Mapping[str, Any]) -> str:
    """The ``"id"`` of a slot holding the edits ``ids``, of the form ``entry`` has."""
    return chat_id(ids[0]) if is_chat_entry(entry) else str(ids[0])


def chat_entries(entries: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The metadata of the chat slots of request slots described by ``entries``, in their order."""
    return [{**e, "id": chat_id(e["id"]), "form": CHAT_FORM} for e in entries]


def chat_slot_owner(owner: torch.Tensor, is_chat: torch.Tensor, n: int) -> torch.Tensor:
    """``owner`` (a request slot per row) with the rows of chat forms moved to their chat slot."""
    return torch.where(is_chat, owner + n, owner)


def open_at_of(entries: Sequence[Mapping[str, Any]], cfg: BuildConfig) -> torch.Tensor:
    """Each slot's ``calibration_open_at``: the configured one, 1 (the worst anchor) for chat slots."""
    return torch.tensor([1.0 if is_chat_entry(e) else cfg.calibration_open_at for e in entries], dtype=torch.float64)
