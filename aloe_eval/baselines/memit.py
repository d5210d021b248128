"""MEMIT (Meng et al., 2023) as an editor of the evaluation protocol: a batch of edits written into
the down-projections of several consecutive layers at once.

Each edit's target z is the residual stream after the last edited layer at its subject's last token,
plus the delta of :mod:`.target_values` (fitted on the unedited model). The layers are then
edited in order; before each, the keys (the layer's inputs at the subjects, averaged over the context
prefixes as :func:`.layer_inputs.averaged_subject_keys` does) and the current residual at the last
layer are read from the model with the earlier layers' changes in place, and the layer takes its share
of what is still missing, R / (layers left), by the least-squares update

    dW = R^T K (lambda C + K^T K)^-1

(K the keys, n x d; R the residuals, n x d_out; C the second moment of the layer's inputs over local
text, lambda its weight). AlphaEdit (:mod:`.alphaedit`) shares everything here but that update.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .layer_inputs import averaged_subject_keys, locatable, residual_at_subjects
from .target_values import MEMIT_VALUE, ValueSettings, cached_value
from .weight_delta import WeightDeltaEditor, zero_deltas

#: an update rule: (index of the layer among the edited ones, layer, keys K (n, d), residual share
#: R (n, d_out)) -> dW (d_out, d), all float64
Update = Callable[[int, int, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class MemitSettings:
    """MEMIT's hyperparameters (defaults: EasyEdit's and the AlphaEdit paper's Llama runs, layers 4-8
    of 32, which on SmolLM2's 30 layers are the same early-middle layers, but lambda). lambda was
    chosen on the first 20 CounterFact tuning edits: 15000 (the reference's) gave efficacy 0.50,
    rewordings 0.10 and locality 1.00; 1500 gave 1.00 / 0.40 / 0.90; 150 and 15 gave 1.00 / 0.40 / 0.85."""

    layers: tuple[int, ...] = (4, 5, 6, 7, 8)
    covariance_weight: float = 1500.0  # lambda, chosen on the tuning slice (see the class docstring)
    value: ValueSettings = MEMIT_VALUE


def memit_update(second_moments: dict[int, torch.Tensor], weight: float) -> Update:
    """MEMIT's update with ``weight * C`` of each layer as the regulariser."""

    def update(i: int, layer: int, K: torch.Tensor, R: torch.Tensor) -> torch.Tensor:
        A = weight * second_moments[layer].double() + K.T @ K
        return torch.linalg.solve(A, K.T @ R).T  # = R^T K A^-1, A symmetric

    return update


def target_deltas(
    model: nn.Module,
    tokenizer,
    requests: Sequence[Any],
    layer: int,
    prefixes: Sequence[str],
    settings: ValueSettings,
    cache_dir: str | Path,
    progress: bool = False,
) -> torch.Tensor:
    """Each request's target delta at ``layer`` for the model as it is, (n, d_out) float64 (cached)."""
    from tqdm.auto import tqdm

    rows = [
        cached_value(model, tokenizer, r.prompt, r.subject, r.target_new, layer, cache_dir, prefixes, settings).double()
        for r in tqdm(requests, desc=f"target values at layer {layer}", disable=not progress)
    ]
    return torch.stack(rows)


def spread_over_layers(
    model: nn.Module,
    tokenizer,
    requests: Sequence[Any],
    layers: Sequence[int],
    deltas: torch.Tensor,
    groups: Sequence[Sequence[str]],
    update: Update,
    editor: WeightDeltaEditor,
) -> None:
    """Write ``deltas`` (n, d_out) at the subjects' residual after ``layers[-1]`` into ``layers``, in
    order, adding each layer's change to ``editor.deltas`` (the model is left as it was)."""
    prompts, subjects = [r.prompt for r in requests], [r.subject for r in requests]
    z_layer = layers[-1]
    editor.attach(model)
    try:
        target = residual_at_subjects(model, tokenizer, prompts, subjects, z_layer) + deltas
    finally:
        editor.detach(model)
    for i, layer in enumerate(layers):
        editor.attach(model)  # the changes so far in place
        try:
            K = averaged_subject_keys(model, tokenizer, prompts, subjects, layer, groups)
            R = target - residual_at_subjects(model, tokenizer, prompts, subjects, z_layer)
        finally:
            editor.detach(model)
        dW = update(i, layer, K, R / (len(layers) - i))
        editor.deltas[layer] = editor.deltas[layer] + dW.float()


def fit_memit(
    model: nn.Module,
    tokenizer,
    requests: Sequence[Any],
    second_moments: dict[int, torch.Tensor],
    groups: Sequence[Sequence[str]],
    cache_dir: str | Path,
    settings: MemitSettings = MemitSettings(),
    progress: bool = False,
) -> WeightDeltaEditor:
    """MEMIT over ``requests`` (``prompt``, ``subject``, ``target_new``) as one batch; the model is
    left as it was. ``groups``: the context prefixes (:func:`.context_prefixes.prefix_groups`)."""
    from .context_prefixes import flat

    usable, skipped = locatable(tokenizer, requests, flat(groups))
    editor = WeightDeltaEditor("MEMIT (reimplementation)", "memit", zero_deltas(model, settings.layers))
    if usable:
        deltas = target_deltas(model, tokenizer, usable, settings.layers[-1], flat(groups), settings.value, cache_dir, progress)
        update = memit_update(second_moments, settings.covariance_weight)
        spread_over_layers(model, tokenizer, usable, settings.layers, deltas, groups, update, editor)
    editor._info = {
        "edits": len(requests),
        "skipped_subject_not_found": skipped,
        "covariance_weight": settings.covariance_weight,
        "value": dataclasses.asdict(settings.value),
        "prefixes": [list(g) for g in groups],
    }
    return editor
