"""What a later append needs from a build, kept beside the operator in its artifact directory.

An append (:mod:`aloe_build.append`) builds slots for new edits against an
existing operator without recomputing anything of the old ones. It needs

- the old slots' anchor states (the new slots must stay shut on them), and
- each old slot's worst anchor score and worst negative score, so that an old
  slot that would open on the new edits' states can be recalibrated by the
  closed form of stage 5 (:func:`aloe_build.stages.s5_calibrate.recalibrate`).

Files: ``aloe_build_state.safetensors`` (``anchors`` (A, d) float32 unit rows,
``anchor_owner`` (A,), ``worst_positive`` (n,), ``worst_negative`` (n,)) and
``aloe_build_state.json`` (format version, the hash of the operator it belongs
to, the build configuration). Loading checks the version, that the operator
hash matches the operator in the same directory, shapes and finiteness.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from aloe_kernels import AloeOperator

from .checkpoints import save_tensors_atomically, write_atomically

STATE_TENSORS = "aloe_build_state.safetensors"
STATE_META = "aloe_build_state.json"
STATE_VERSION = 1


class BuildStateError(ValueError):
    """The build state of an artifact is missing, of another operator, or corrupt."""


@dataclass
class BuildState:
    """Per-slot summaries and anchor states of an operator's build (rows follow the operator's slots)."""

    anchors: torch.Tensor  # (A, d) float32
    anchor_owner: torch.Tensor  # (A,) int64 slot of each anchor
    worst_positive: torch.Tensor  # (n,) float32: min score of the slot's address on its required anchors
    worst_negative: torch.Tensor  # (n,) float32: max score on its negatives (raised by recalibration)
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return int(self.worst_positive.shape[0])

    def select(self, rows: Sequence[int]) -> "BuildState":
        """The state of the slots ``rows`` (in that order), anchors renumbered."""
        rows_t = torch.as_tensor(list(rows), dtype=torch.long)
        remap = torch.full((self.n,), -1, dtype=torch.long)
        remap[rows_t] = torch.arange(len(rows_t))
        keep = remap[self.anchor_owner] >= 0
        return BuildState(
            self.anchors[keep],
            remap[self.anchor_owner[keep]],
            self.worst_positive[rows_t],
            self.worst_negative[rows_t],
            dict(self.config),
        )

    @staticmethod
    def merge(states: Sequence["BuildState"]) -> "BuildState":
        """The states of operators concatenated in this order (:meth:`AloeOperator.merge`)."""
        offsets = [0]
        for s in states:
            offsets.append(offsets[-1] + s.n)
        return BuildState(
            torch.cat([s.anchors for s in states]),
            torch.cat([s.anchor_owner + o for s, o in zip(states, offsets)]),
            torch.cat([s.worst_positive for s in states]),
            torch.cat([s.worst_negative for s in states]),
            dict(states[-1].config),
        )

    def save(self, directory: str | Path, op: AloeOperator) -> None:
        """Write the state beside ``op``'s artifact in ``directory``, bound to ``op``'s hash."""
        self.check(op)
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        save_tensors_atomically(
            {
                "anchors": self.anchors.float().contiguous(),
                "anchor_owner": self.anchor_owner.long().contiguous(),
                "worst_positive": self.worst_positive.float().contiguous(),
                "worst_negative": self.worst_negative.float().contiguous(),
            },
            out / STATE_TENSORS,
        )
        meta = {
            "format_version": STATE_VERSION,
            "operator_hash": op.fingerprint(),
            "n": self.n,
            "anchors": int(self.anchors.shape[0]),
            "config": self.config,
        }
        write_atomically(out / STATE_META, lambda tmp: tmp.write_text(json.dumps(meta, indent=1)))

    @classmethod
    def load(cls, directory: str | Path, op: AloeOperator) -> "BuildState":
        """Read and validate the state in ``directory`` for the operator ``op`` loaded from it."""
        d = Path(directory)
        if not (d / STATE_META).is_file() or not (d / STATE_TENSORS).is_file():
            raise BuildStateError(
                f"{d} has no build state ({STATE_META}, {STATE_TENSORS}): it was not written by "
                "`aloe build`/`aloe append` of this version, so edits cannot be appended to it; "
                "rebuild it once with `aloe build`"
            )
        meta = json.loads((d / STATE_META).read_text())
        if meta.get("format_version") != STATE_VERSION:
            raise BuildStateError(f"{d / STATE_META}: format_version {meta.get('format_version')!r}, expected {STATE_VERSION}")
        if meta.get("operator_hash") != op.fingerprint():
            raise BuildStateError(
                f"{d / STATE_META} belongs to operator {meta.get('operator_hash')}, not to the "
                f"operator in {d} ({op.fingerprint()}): the artifact was changed after its build"
            )
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            t = load_file(str(d / STATE_TENSORS))
        except (SafetensorError, OSError) as exc:
            raise BuildStateError(f"{d / STATE_TENSORS}: unreadable ({exc})") from exc
        missing = {"anchors", "anchor_owner", "worst_positive", "worst_negative"} - set(t)
        if missing:
            raise BuildStateError(f"{d / STATE_TENSORS}: missing tensors {sorted(missing)}")
        state = cls(t["anchors"], t["anchor_owner"], t["worst_positive"], t["worst_negative"], meta.get("config", {}))
        state.check(op)
        return state

    def check(self, op: AloeOperator) -> None:
        """Shapes, ranges and finiteness against the operator the state describes."""
        if self.anchors.dim() != 2 or self.anchors.shape[1] != op.d:
            raise BuildStateError(f"build state: anchors of shape {tuple(self.anchors.shape)}, expected (A, {op.d})")
        if self.anchor_owner.shape != (self.anchors.shape[0],):
            raise BuildStateError("build state: anchor_owner does not have one entry per anchor")
        if self.worst_positive.shape != (op.n,) or self.worst_negative.shape != (op.n,):
            raise BuildStateError(f"build state: per-slot scores for {self.n} slots, the operator has {op.n}")
        if self.anchor_owner.numel() and (int(self.anchor_owner.min()) < 0 or int(self.anchor_owner.max()) >= op.n):
            raise BuildStateError(f"build state: anchor owners outside 0..{op.n - 1}")
        for name in ("anchors", "worst_positive", "worst_negative"):
            if not bool(torch.isfinite(getattr(self, name)).all()):
                raise BuildStateError(f"build state: {name} holds NaN or Inf")
