"""ROME (Meng et al., 2022) as an editor of the evaluation protocol: each edit is a rank-one change
of one layer's MLP down-projection, applied in stream order (each edit's key and value are read
from the model with the edits before it in place, as sequential ROME does).

Key: the down-projection input at the subject's last token, averaged over the context prefixes (the
direction of the change) and on the plain prompt (the key mapped exactly). Value: the layer's output
there plus the optimized delta (:mod:`.target_values`). The second moment C is the ROME paper's;
EasyEdit's published ROME configurations set ``mom2_adjustment: false``, which is C = I. Update: the
closed form of :mod:`.rank_one` with the layer's input second moment (:mod:`.second_moments`).
The editor is a :class:`.weight_delta.WeightDeltaEditor` of the one layer.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from aloe_kernels.hf import locate_down_proj

from .layer_inputs import averaged_subject_keys, locatable
from .rank_one import rank_one_update
from .target_values import ValueSettings, cached_value
from .weight_delta import WeightDeltaEditor, zero_deltas


def subject_key(model: nn.Module, tokenizer, prompt: str, subject: str, layer: int, prefixes: Sequence[str]) -> torch.Tensor:
    """The edit's key: the layer's down-projection input at the subject's last token, averaged
    over the prompt after each prefix (ROME's k*)."""
    return averaged_subject_keys(model, tokenizer, [prompt], [subject], layer, [list(prefixes)])[0]


def fit_rome(
    model: nn.Module,
    tokenizer,
    requests: Sequence[Any],
    layer: int,
    second_moment: torch.Tensor,
    cache_dir: str | Path,
    prefixes: Sequence[str] = ("",),
    settings: ValueSettings = ValueSettings(),
    progress: bool = False,
) -> WeightDeltaEditor:
    """Sequential ROME over ``requests`` (``prompt``, ``subject``, ``target_new``); the model is left
    as it was. Values are cached in ``cache_dir`` for the model as each edit finds it."""
    from tqdm.auto import tqdm

    usable, skipped = locatable(tokenizer, requests, prefixes)
    editor = WeightDeltaEditor("ROME (reimplementation)", "rome", zero_deltas(model, [layer]))
    try:
        for r in tqdm(usable, desc="ROME edits", disable=not progress):
            editor.detach(model)
            editor.attach(model)  # the edits so far in place
            W = locate_down_proj(model, layer).weight().detach().double()
            k_avg = subject_key(model, tokenizer, r.prompt, r.subject, layer, prefixes)
            k = subject_key(model, tokenizer, r.prompt, r.subject, layer, ("",)) if tuple(prefixes) != ("",) else k_avg
            delta = cached_value(model, tokenizer, r.prompt, r.subject, r.target_new, layer, cache_dir, prefixes, settings)
            # as EasyEdit's ROME: along C^-1 k_avg, mapping the plain prompt's key to its output plus delta
            dW = rank_one_update(W, second_moment, k, W @ k + delta.double(), direction=k_avg)
            editor.deltas[layer] = editor.deltas[layer] + dW.float()
    finally:
        editor.detach(model)
    editor._info = {
        "edits": len(requests),
        "skipped_subject_not_found": skipped,
        "prefixes": list(prefixes),
        "value": dataclasses.asdict(settings),
    }
    return editor
