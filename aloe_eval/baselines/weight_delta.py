"""The editor of the weight editors (ROME, MEMIT, AlphaEdit): a summed change of one or more MLP
down-projection weights, added on attach and undone bit for bit on detach."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from aloe_kernels import weight_fingerprint
from aloe_kernels.hf import locate_down_proj

from ..content_key import content_key
from ..editors import Editor


class WeightDeltaEditor(Editor):
    """Changes ``deltas[layer]`` (d_out, d), float32, of the down-projections of the given layers.

    ``layer`` (the protocol's edited layer) is the last of them."""

    def __init__(self, name: str, kind: str, deltas: dict[int, torch.Tensor], info: dict[str, Any] | None = None):
        if not deltas:
            raise ValueError("WeightDeltaEditor needs at least one layer")
        self.name = name
        self.kind = kind
        self.deltas = dict(deltas)
        self.layer = max(self.deltas)
        self._info = info or {}
        self._saved: dict[int, torch.Tensor] | None = None

    def attach(self, model: nn.Module) -> None:
        if self._saved is not None:
            raise RuntimeError(f"{self.name} is already attached")
        self._saved = {}
        for layer, delta in self.deltas.items():
            w = _weight_param(model, layer)
            self._saved[layer] = w.detach().clone()
            with torch.no_grad():
                w.add_(_as_stored(delta, model, layer).to(w.dtype))

    def detach(self, model: nn.Module) -> None:
        if self._saved is None:
            return
        with torch.no_grad():
            for layer, saved in self._saved.items():
                _weight_param(model, layer).copy_(saved)
        self._saved = None

    def info(self) -> dict[str, Any]:
        return {"kind": self.kind, "layers": sorted(self.deltas), **self._info}

    def state_key(self) -> str:
        return content_key([self.kind, [[layer, weight_fingerprint(d)] for layer, d in sorted(self.deltas.items())]])


def zero_deltas(model: nn.Module, layers) -> dict[int, torch.Tensor]:
    """A zero change for each layer's down-projection, (d_out, d) float32."""
    return {layer: torch.zeros(locate_down_proj(model, layer).d_out, locate_down_proj(model, layer).d) for layer in layers}


def _weight_param(model: nn.Module, layer: int) -> torch.Tensor:
    return locate_down_proj(model, layer).base.weight


def _as_stored(delta: torch.Tensor, model: nn.Module, layer: int) -> torch.Tensor:
    """A (d_out, d) change in the module's own layout (GPT-2's Conv1D stores the transpose)."""
    return delta.T if locate_down_proj(model, layer).is_conv1d else delta
