"""ROME (Meng et al., 2022) as an editor of the evaluation protocol: each edit is a rank-one change
of one layer's MLP down-projection, applied in stream order (each edit's key and value are read
from the model with the edits before it in place, as sequential ROME does).

Key: the down-projection input at the subject's last token, averaged over the context prefixes (the
direction of the change) and on the plain prompt (the key mapped exactly). Value: the layer's output
there plus the optimized delta (:mod:`.target_values`). The second moment C is the ROME paper's;
EasyEdit's published ROME configurations set ``mom2_adjustment: false``, which is C = I. Update: the
closed form of :mod:`.rank_one` with the layer's input second moment (:mod:`.second_moments`).
Attaching adds the summed change to the weight; detaching puts back the original bits.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from aloe_kernels.hf import locate_down_proj

from ..editors import Editor
from .layer_inputs import subject_keys
from .rank_one import rank_one_update
from .target_values import ValueSettings, cached_value


class RomeEditor(Editor):
    """A summed weight change of one down-projection, (d_out, d) in float32."""

    name = "ROME (reimplementation)"

    def __init__(self, layer: int, delta_weight: torch.Tensor, info: dict[str, Any] | None = None):
        self.layer = layer
        self.delta_weight = delta_weight
        self._info = info or {}
        self._saved: torch.Tensor | None = None

    def attach(self, model: nn.Module) -> None:
        if self._saved is not None:
            raise RuntimeError("RomeEditor is already attached")
        w = _weight_param(model, self.layer)
        self._saved = w.detach().clone()
        with torch.no_grad():
            w.add_(_as_stored(self.delta_weight, model, self.layer).to(w.dtype))

    def detach(self, model: nn.Module) -> None:
        if self._saved is None:
            return
        with torch.no_grad():
            _weight_param(model, self.layer).copy_(self._saved)
        self._saved = None

    def info(self) -> dict[str, Any]:
        return {"kind": "rome", "layer": self.layer, **self._info}


def _weight_param(model: nn.Module, layer: int) -> torch.Tensor:
    return locate_down_proj(model, layer).base.weight


def _as_stored(delta: torch.Tensor, model: nn.Module, layer: int) -> torch.Tensor:
    """A (d_out, d) change in the module's own layout (GPT-2's Conv1D stores the transpose)."""
    return delta.T if locate_down_proj(model, layer).is_conv1d else delta


def subject_key(model: nn.Module, tokenizer, prompt: str, subject: str, layer: int, prefixes: Sequence[str]) -> torch.Tensor:
    """The edit's key: the layer's down-projection input at the subject's last token, averaged
    over the prompt after each prefix (ROME's k*)."""
    texts = [p + prompt for p in prefixes]
    return subject_keys(model, tokenizer, texts, [subject] * len(texts), layer).double().mean(0)


def fit_rome(
    model: nn.Module,
    tokenizer,
    requests: Sequence[Any],
    layer: int,
    second_moment: torch.Tensor,
    cache_dir: str | Path,
    prefixes: Sequence[str] = ("",),
    settings: ValueSettings = ValueSettings(),
) -> RomeEditor:
    """Sequential ROME over ``requests`` (``prompt``, ``subject``, ``target_new``); the model is left
    as it was. Values are cached in ``cache_dir`` for the model as each edit finds it."""
    editor = RomeEditor(layer, torch.zeros(locate_down_proj(model, layer).d_out, locate_down_proj(model, layer).d))
    try:
        for r in requests:
            editor.detach(model)
            editor.attach(model)  # the edits so far in place
            W = locate_down_proj(model, layer).weight().detach().double()
            k_avg = subject_key(model, tokenizer, r.prompt, r.subject, layer, prefixes)
            k = subject_key(model, tokenizer, r.prompt, r.subject, layer, ("",)) if tuple(prefixes) != ("",) else k_avg
            delta = cached_value(model, tokenizer, r.prompt, r.subject, r.target_new, layer, cache_dir, prefixes, settings)
            # as EasyEdit's ROME: along C^-1 k_avg, mapping the plain prompt's key to its output plus delta
            dW = rank_one_update(W, second_moment, k, W @ k + delta.double(), direction=k_avg)
            editor.delta_weight = editor.delta_weight + dW.float()
    finally:
        editor.detach(model)
    editor._info = {"edits": len(requests), "prefixes": len(prefixes), **settings.__dict__}
    return editor
