"""FT-M (the constrained fine-tuning baseline of EasyEdit's survey, Zhang et al., 2024) as an editor of the
evaluation protocol: each edit fine-tunes one MLP down-projection weight on its target tokens.

As EasyEdit's FT with ``objective_optimization: target_new`` (the survey's "FT-M", its ``hparams/FT``
Llama-7B values):

* **What is trained.** The down-projection weight of one layer, nothing else; every other parameter is
  frozen. The reference's Llama-7B layer is 21 of 32, which is 20 of SmolLM2's 30; the default here is
  :data:`FTM_LAYER`, 8 of 30 (scaled to the model's depth by :func:`ftm_layer`), chosen on the CounterFact
  tuning slice (val records 1500-1519, and 1500-1539 for the two best), every other value as below, by the
  mean of efficacy, generalization and locality:

  ======  =====  =========  ===============  ========  ======
  layer   edits  efficacy   generalization   locality  mean
  ======  =====  =========  ===============  ========  ======
  8       20     1.00       0.10             0.35      0.48
  14      20     0.80       0.05             0.10      0.32
  20      20     1.00       0.15             0.10      0.42
  25      20     0.95       0.10             0.20      0.42
  29      20     0.85       0.20             0.05      0.37
  8       40     0.80       0.125            0.225     0.38
  20      40     0.725      0.125            0.125     0.33
  ======  =====  =========  ===============  ========  ======

  At every layer the sequential fine-tuning costs most of the locality on this model.
* **Loss.** Teacher-forced ``prompt + " " + target``; the cross-entropy of the target tokens only,
  averaged over them (the prompt tokens are masked out of the loss: "FT-M"; FT-L would score the last
  prompt token instead). The target tokens are those of :func:`aloe_build.tokens.encode_continuation`,
  the tokens the evaluation scores.
* **Optimizer.** Adam, ``lr = 5e-4``, no weight decay, a fresh optimizer for every edit (the reference
  builds one per call), at most 25 steps on the one request (``batch_size: 1``); no step is taken, and
  the edit ends, once the loss is below ``1e-2``. ``norm_constraint: false``: the weight is not clamped
  (:attr:`FtmSettings.norm_constraint` clamps it elementwise around the edit's starting weight, as the
  reference's float setting does).
* **Sequential.** Edits are fine-tuned in stream order, each on the model carrying the ones before it
  (EasyEdit's ``sequential_edit``); the editor is the summed change, a
  :class:`.weight_delta.WeightDeltaEditor` of the one layer.

Fitting is resumable: with a checkpoint directory the trained weight is saved every
``checkpoint_every`` edits, and a rerun of the same fit starts after the last saved edit.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from aloe_build.checkpoints import run_key
from aloe_build.forward import model_device, progress_bar
from aloe_build.tokens import encode_continuation
from aloe_kernels import weight_fingerprint
from aloe_kernels.hf import locate_down_proj

from ..content_key import content_key
from .peak_memory import peak_memory_mb
from .weight_delta import WeightDeltaEditor

__all__ = ["FTM_CACHE", "FtmSettings", "fit_ft_m", "ftm_layer"]

NAME = "FT-M (reimplementation)"
#: Directory under ALOE's cache root where ``aloe eval --baseline ft-m`` saves its fits as they go.
FTM_CACHE = "ft-m"
#: Bump when what fitting an edit computes changes (it keys the saved fits).
FIT_FORMAT = 1
#: The reference's edited layer and its model's depth (Llama-7B: layer 21 of 32).
REFERENCE_LAYER, REFERENCE_DEPTH = 21, 32
#: The default layer on a model of FTM_DEPTH layers, chosen on the tuning slice (see the module docstring).
FTM_LAYER, FTM_DEPTH = 8, 30


@dataclasses.dataclass(frozen=True)
class FtmSettings:
    """FT-M's hyperparameters (defaults: EasyEdit's ``hparams/FT/llama-7b.yaml`` with ``target_new``)."""

    layer: int | None = None  # None: FTM_LAYER scaled to the model's depth (ftm_layer)
    lr: float = 5e-4
    steps: int = 25
    weight_decay: float = 0.0
    norm_constraint: float | None = None  # the reference's ``norm_constraint: false``
    stop_loss: float = 1e-2  # no step below this loss; the edit ends there


def ftm_layer(model: nn.Module, reference: bool = False) -> int:
    """:data:`FTM_LAYER` of 30 at the model's depth; with ``reference``, the reference's layer 21 of 32
    at the model's depth instead (20 of SmolLM2's 30)."""
    from aloe_build.models import num_decoder_layers

    n = num_decoder_layers(model)
    layer, depth = (REFERENCE_LAYER, REFERENCE_DEPTH) if reference else (FTM_LAYER, FTM_DEPTH)
    return min(n - 1, int(layer * n / depth + 0.5))


def fit_ft_m(
    model: nn.Module,
    tokenizer,
    requests: Sequence[Any],
    settings: FtmSettings = FtmSettings(),
    *,
    progress: bool = False,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 25,
) -> WeightDeltaEditor:
    """Sequential FT-M over ``requests`` (``prompt``, ``target_new``); the model is left as it was.

    With ``checkpoint_dir`` the trained weight is saved there every ``checkpoint_every`` edits (and at the
    end), under a key of the requests, the weight, the layer and ``settings``; a rerun resumes after the
    last saved edit (the info's ``resumed_edits`` says how many were read back)."""
    t0 = time.perf_counter()
    layer = ftm_layer(model) if settings.layer is None else settings.layer
    site = locate_down_proj(model, layer)
    param = site.base.weight
    original = param.detach().clone()
    encoded = [encode_continuation(tokenizer, r.prompt, r.target_new) for r in requests]
    saves = _DeltaCheckpoint(checkpoint_dir, original, requests, layer, settings)
    log: list[dict[str, float]] = []
    trainable = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    bar = progress_bar(len(requests), "FT-M edits", progress)
    try:
        resumed = saves.restore(param, log)
        bar.update(resumed)
        for i in range(resumed, len(requests)):
            log.append(_fine_tune(model, param, encoded[i], settings))
            if (i + 1) % max(1, checkpoint_every) == 0 or i + 1 == len(requests):
                saves.save(param.detach(), log)
            bar.update(1)
        stored = param.detach() - original
    finally:
        bar.close()
        with torch.no_grad():
            param.copy_(original)  # the model as it came, bit for bit
        for p, flag in zip(model.parameters(), trainable):
            p.requires_grad_(flag)
    delta = (stored.T if site.is_conv1d else stored).float().cpu()
    info = {
        "edits": len(requests),
        "layer": layer,
        "module_path": site.path,
        "settings": dataclasses.asdict(settings),
        "steps": _stats([e["steps"] for e in log]),
        "final_loss": _stats([e["loss_last"] for e in log]),
        "delta_norm": float(delta.norm()),
        "fit_s": time.perf_counter() - t0,
        "resumed_edits": resumed,
        "peak_memory_mb": peak_memory_mb(),
    }
    return WeightDeltaEditor(NAME, "ft-m", {layer: delta}, info)


def _fine_tune(model: nn.Module, param: nn.Parameter, enc: tuple, settings: FtmSettings) -> dict[str, float]:
    """Fine-tune ``param`` in place on one request; returns its first and last loss and the steps taken."""
    prompt, target = enc
    device = model_device(model)
    ids = torch.tensor([list(prompt) + list(target)], device=device)
    labels = torch.tensor(target, device=device)
    k = len(target)
    start = param.detach().clone() if settings.norm_constraint is not None else None
    opt = torch.optim.Adam([param], lr=settings.lr, weight_decay=settings.weight_decay)
    param.requires_grad_(True)
    first = last = float("nan")
    steps = 0
    try:
        for it in range(settings.steps):
            # only the positions that predict the target tokens go through the output head: the
            # prompt tokens are not in the loss
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=k + 1).logits[0, :k].float()
            loss = F.cross_entropy(logits, labels)
            last = float(loss.detach())
            if it == 0:
                first = last
            if last < settings.stop_loss:
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps += 1
            if start is not None:
                c = settings.norm_constraint
                with torch.no_grad():
                    param.copy_(torch.clamp(param, min=start - c, max=start + c))
    finally:
        param.requires_grad_(False)
        param.grad = None
    return {"steps": steps, "loss_first": first, "loss_last": last}


def _stats(xs: list[float]) -> dict[str, float]:
    return {"mean": sum(xs) / max(1, len(xs)), "max": max(xs, default=0.0)}


class _DeltaCheckpoint:
    """The trained weight after the last saved edit and the log so far, in one safetensors file of
    ``root`` named by what the fit depends on (``root`` None: nothing is saved or read). The weight
    itself is kept, not its change, so that a resumed fit goes on from the very same numbers."""

    def __init__(self, root, weight: torch.Tensor, requests: Sequence[Any], layer: int, settings: FtmSettings):
        key = content_key([run_key(requests, weight_fingerprint(weight), layer), FIT_FORMAT, dataclasses.asdict(settings)])
        self.file = None if root is None else Path(root) / f"ft-m-layer{layer}-{key}.safetensors"

    def restore(self, param: nn.Parameter, log: list[dict[str, float]]) -> int:
        """Load the saved weight into ``param`` and the saved log into ``log``; the edits done."""
        from aloe_build.checkpoints import load_tensors

        saved = load_tensors(self.file)
        if saved is None:
            return 0
        tensors, meta = saved
        with torch.no_grad():
            param.copy_(tensors["weight"])
        saved_log = json.loads(meta["log"])
        log.extend(saved_log)
        return len(saved_log)

    def save(self, weight: torch.Tensor, log: list[dict[str, float]]) -> None:
        if self.file is None:
            return
        from aloe_build.checkpoints import save_tensors_atomically

        save_tensors_atomically({"weight": weight.cpu().contiguous()}, self.file, metadata={"log": json.dumps(log)})
