"""WISE's fitting state, and its checkpoint: an interrupted fit over a long stream resumes at its first
edit not yet saved, with the very same numbers."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch

__all__ = ["WiseCheckpoint", "WiseState"]


@dataclasses.dataclass
class WiseState:
    """Where a WISE fit stands after ``done`` edits.

    ``side``: the side memory being written (d_out, d) float32; ``side_min``: the smallest in-scope score
    of its edits (inf before any); ``memories`` / ``memory_mins``: the saved (and merged) shards and theirs;
    ``log``: one record per edit."""

    side: torch.Tensor
    side_min: float = math.inf
    memories: list[torch.Tensor] = dataclasses.field(default_factory=list)
    memory_mins: list[float] = dataclasses.field(default_factory=list)
    done: int = 0
    log: list[dict[str, Any]] = dataclasses.field(default_factory=list)


class WiseCheckpoint:
    """A :class:`WiseState` in one safetensors file of ``root`` named ``wise-layer<L>-<key>``
    (``root`` None: nothing is saved or read)."""

    def __init__(self, root: str | Path | None, layer: int, key: str):
        self.file = None if root is None else Path(root) / f"wise-layer{layer}-{key}.safetensors"

    def restore(self) -> WiseState | None:
        """The saved state, or None."""
        from aloe_build.checkpoints import load_tensors

        saved = load_tensors(self.file)
        if saved is None:
            return None
        tensors, metadata = saved
        meta = json.loads(metadata["state"])
        memories = [tensors[f"memory_{i}"] for i in range(len(meta["memory_mins"]))]
        return WiseState(tensors["side"], meta["side_min"], memories, meta["memory_mins"], meta["done"], meta["log"])

    def save(self, state: WiseState) -> None:
        if self.file is None:
            return
        from aloe_build.checkpoints import save_tensors_atomically

        tensors = {"side": state.side.detach().cpu().contiguous()}
        tensors.update({f"memory_{i}": m.detach().cpu().contiguous() for i, m in enumerate(state.memories)})
        meta = {"side_min": state.side_min, "memory_mins": state.memory_mins, "done": state.done, "log": state.log}
        save_tensors_atomically(tensors, self.file, metadata={"state": json.dumps(meta)})
