"""Editors: what an evaluation patches into the model, scores, and removes again."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from aloe_build.chat_slots import is_chat_entry
from aloe_kernels import AloeOperator, aloe_gates, apply_aloe, remove_aloe
from aloe_kernels.reading import reading_tracked
from aloe_kernels.write_positions import DEFAULT_WRITE_POSITIONS, check_write_positions

from .content_key import content_key


class Editor:
    """Something that edits a model in place for evaluation, and can be undone.

    Subclasses set ``name`` and ``layer`` and implement :meth:`attach` and
    :meth:`detach`. Slot-based editors also implement :meth:`slot_activations`
    (activations of every slot for down-projection inputs ``h``, shape
    ``(..., n_slots)``, in [0, 1]) and :meth:`slot_of` (the slot of a request).
    """

    name: str = "editor"
    layer: int | None = None
    #: seconds it took to fit the editor on the stream, where it was fitted for the evaluation
    fit_seconds: float | None = None

    def attach(self, model: nn.Module) -> None:
        raise NotImplementedError

    def detach(self, model: nn.Module) -> None:
        raise NotImplementedError

    @property
    def has_slots(self) -> bool:
        return False

    def slot_activations(self, h: torch.Tensor) -> torch.Tensor | None:
        return None

    def reading(self, model: nn.Module) -> contextlib.AbstractContextManager:
        """Within the context, the states collected from ``model`` are what :meth:`slot_activations`
        reads (attached or not: an operator whose gates read a running mean, :mod:`aloe_kernels.reading`)."""
        return contextlib.nullcontext()

    def slot_of(self, request: Any, index: int) -> int | None:
        return None

    def chat_slot_of(self, request: Any, index: int) -> int | None:
        """The slot a request asked through the chat template is addressed to (its :meth:`slot_of`
        unless the editor keeps a slot for chat forms)."""
        return self.slot_of(request, index)

    def edit_slots(self, request: Any, index: int) -> tuple[int, ...]:
        """Every slot of the request's edit: its slot and, where it differs, its chat slot."""
        return tuple(dict.fromkeys(s for s in (self.slot_of(request, index), self.chat_slot_of(request, index)) if s is not None))

    def info(self) -> dict[str, Any]:
        return {}

    def state_key(self) -> str | None:
        """What the edited model's answers depend on besides the model (its fitted tensors, never its
        timings): saved answers are read back under it. None: the editor cannot say, nothing is reused."""
        return None


class _UnpatchedEditor(Editor):
    """An editor that leaves the model's weights alone (attach and detach do nothing)."""

    def __init__(self, layer: int | None = None):
        self.layer = layer

    def attach(self, model: nn.Module) -> None:
        pass

    def detach(self, model: nn.Module) -> None:
        pass


class UneditedEditor(_UnpatchedEditor):
    """The model as it is: its numbers are the unedited baseline."""

    name = "unedited"

    def state_key(self) -> str:
        return "unedited"


#: The report's name for the in-context control (:class:`ToldEditor`).
TOLD_NAME = "unedited, told the fact"


class ToldEditor(_UnpatchedEditor):
    """The in-context control: the unedited model, no weight changed, asked every prompt of an edit
    after that edit's statement ("<request> <target>. <prompt>", :func:`aloe_eval.plan.told_plan`),
    its locality answers compared with the unedited model's answers to the plain prompts. It is what
    an edit is measured against: the new fact given in the context instead of written into weights.
    The evaluation recognizes it by its class and scores it on the told prompts."""

    name = TOLD_NAME

    def info(self) -> dict[str, Any]:
        return {"kind": "told", "prompts": "<request> <target>. <prompt>"}

    def state_key(self) -> str:
        # the same weights as the unedited model, asked other prompts: its answers must never be read
        # back as the unedited model's (nor theirs as its)
        return "told"


class AloeEditor(Editor):
    """An ALOE operator patched into the model with :func:`aloe_kernels.apply_aloe`."""

    def __init__(
        self,
        op,
        name: str = "ALOE",
        check_fingerprint: bool = True,
        layer: int | None = None,
        dtype: torch.dtype | None = None,
        write_positions: str = DEFAULT_WRITE_POSITIONS,
    ):
        """``dtype``: precision of the patched operator (``None``: as served, see :func:`apply_aloe`);
        ``write_positions`` as in :func:`apply_aloe`."""
        if not isinstance(op, AloeOperator):
            raise TypeError(f"AloeEditor needs an AloeOperator, got {type(op).__name__}")
        self.op = op
        self.name = name
        self.check_fingerprint = check_fingerprint
        self.dtype = dtype
        self.write_positions = check_write_positions(write_positions)
        self.layer = op.layer if layer is None else layer
        if self.layer is None:
            raise ValueError("the operator records no layer; pass layer=")
        self._by_id: dict[str, int] = {}
        for i, e in enumerate(op.edits):  # a slot shared by identical edits lists them all under "ids"
            for rid in [e.get("id"), *(e.get("ids") or [])]:
                if rid is not None:
                    self._by_id.setdefault(str(rid), i)
        # a chat slot's "ids" are its edit's, and they name the request slot, listed first
        self._chat_of = {self._by_id[str(e["ids"][0])]: i for i, e in enumerate(op.edits) if is_chat_entry(e)}
        self._by_text: dict[tuple[str, str], int] = {}
        for i, e in enumerate(op.edits):
            key = (str(e.get("request") or "").strip(), str(e.get("target") or "").strip())
            if key[0] and key not in self._by_text:
                self._by_text[key] = i
        self._gate_op = op.to("cpu", torch.float64 if op.dtype == torch.float64 else torch.float32)

    def attach(self, model: nn.Module) -> None:
        apply_aloe(
            model,
            self.op,
            layer=self.layer,
            check_fingerprint=self.check_fingerprint,
            dtype=self.dtype,
            write_positions=self.write_positions,
        )

    def detach(self, model: nn.Module) -> None:
        remove_aloe(model)

    def state_key(self) -> str:
        # the operator's tensors and how it is patched in: its precision, write positions and layer
        return content_key([self.name, self.op.fingerprint(), str(self.dtype), self.write_positions, self.layer])

    @property
    def has_slots(self) -> bool:
        return True

    def reading(self, model: nn.Module) -> contextlib.AbstractContextManager:
        return reading_tracked(model, self.op.reading_decay)

    def slot_activations(self, h: torch.Tensor) -> torch.Tensor:
        op = self._gate_op
        if op.device != h.device:
            self._gate_op = op = op.to(h.device)
        return aloe_gates(h, op).float()

    def slot_of(self, request: Any, index: int) -> int | None:
        rid = getattr(request, "id", None)
        if rid is not None and str(rid) in self._by_id:
            return self._by_id[str(rid)]
        return self._by_text.get((request.prompt.strip(), request.target_new.strip()))

    def chat_slot_of(self, request: Any, index: int) -> int | None:
        """The edit's chat slot where the operator has one (``BuildConfig.chat.chat_slots``), else its slot."""
        slot = self.slot_of(request, index)
        if slot is None:
            return None
        return self._chat_of.get(slot, slot)

    def info(self) -> dict[str, Any]:
        op = self.op
        return {
            "kind": "aloe",
            "n_slots": op.n,
            "layer": self.layer,
            "module_path": op.module_path,
            "base_model": op.base_model,
            "operator_hash": op.fingerprint(),
            "weight_fingerprint": op.weight_fingerprint,
            "operator_dtype": "served" if self.dtype is None else str(self.dtype).removeprefix("torch."),
            "write_positions": self.write_positions,
        }


def as_editor(x: Any, layer: int | None) -> Editor:
    """An :class:`Editor` for an operator, an artifact directory or an editor."""
    if isinstance(x, Editor):
        return x
    if isinstance(x, AloeOperator):
        return AloeEditor(x, layer=layer if x.layer is None else None)
    if isinstance(x, (str, os.PathLike)):
        return AloeEditor(AloeOperator.load(x), layer=layer)
    raise TypeError(f"cannot evaluate {type(x).__name__}: pass an AloeOperator, an Editor, or an artifact path")
