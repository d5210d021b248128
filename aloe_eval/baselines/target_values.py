"""The target value of a weight edit (ROME's v*, MEMIT's z): the change delta of one layer's MLP
output at the subject's last token that makes the model produce the new target.

delta is added to the down-projection output of ``layer`` at the last subject token of every
rewriting prompt (the request after each context prefix) and of a "{subject} is a" prompt, and
optimized with Adam on

    NLL(target | prompt) averaged over the prompts
    + kl_weight * KL(edited || unedited) of the next token at the subject of "{subject} is a"
    + weight_decay * |delta| / |h|^2,

its norm clamped to ``clamp_factor * |h|`` after every step, where h is the unedited model's state there
on the first prompt: the MLP's output for ROME (``norm_of="mlp"``), the residual stream after the layer
for MEMIT and AlphaEdit (``norm_of="residual"``). The terms, their forms and the step and stop rules are
those of EasyEdit's ``compute_v`` (ROME) and ``compute_z`` (MEMIT).
Adding delta to a layer's MLP output is adding it to the residual stream after that layer, so the
same delta serves ROME (the edited layer, v* = W k + delta) and MEMIT (z at its last layer). The
settings default to EasyEdit's ROME values for Llama models (25 steps, lr 0.5, KL weight 0.0625,
weight decay 1e-3, clamp 4); :data:`MEMIT_VALUE`, which MEMIT and AlphaEdit share here, takes the same
values with the residual as the clamp's scale, as EasyEdit's MEMIT for Llama-2-7B.
"""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from aloe_build.checkpoints import cached_tensor
from aloe_build.forward import model_device
from aloe_build.tokens import batch_inputs, encode_continuation, encode_prompt, pad_id
from aloe_kernels import weight_fingerprint
from aloe_kernels.hf import decoder_layers, locate_down_proj

from ..content_key import content_key
from .layer_inputs import subject_last_index

#: the optimization stops once its loss is below this (EasyEdit's ROME and MEMIT)
EARLY_STOP_LOSS = 5e-2
#: bumped whenever what optimize_value computes changes (it keys the cache)
VALUE_VERSION = 2


@dataclasses.dataclass(frozen=True)
class ValueSettings:
    """How the target value is optimized (see the module docstring)."""

    steps: int = 25
    lr: float = 0.5
    kl_weight: float = 0.0625
    weight_decay: float = 1e-3
    clamp_factor: float = 4.0
    norm_of: str = "mlp"  # the state whose norm scales the clamp and the decay: "mlp" or "residual"

    def __post_init__(self) -> None:
        if self.norm_of not in ("mlp", "residual"):
            raise ValueError(f"ValueSettings.norm_of must be 'mlp' or 'residual', got {self.norm_of!r}")


#: MEMIT's and AlphaEdit's target values: EasyEdit's MEMIT values for Llama-2-7B. Chosen on the first
#: 20 CounterFact tuning edits over the AlphaEdit paper's Llama-3-8B values (lr 0.1, weight decay 0.5,
#: clamp 0.75), whose values, added at the subject's token, made the target 0.35 of the time against 1.00.
MEMIT_VALUE = ValueSettings(steps=25, lr=0.5, kl_weight=0.0625, weight_decay=1e-3, clamp_factor=4.0, norm_of="residual")


@dataclasses.dataclass
class _Batch:
    inputs: dict[str, torch.Tensor]
    at: torch.Tensor  # (rows,) padded column of each row's subject token
    target_cols: list[list[int]]  # per rewriting row, the columns whose logits predict the target tokens
    target_ids: list[int]


def _batch(tokenizer, prompt: str, subject: str, target: str, prefixes: Sequence[str], device) -> _Batch:
    """The rewriting rows (prefix + prompt + target but its last token), then the KL row."""
    seqs, at, cols = [], [], []
    for prefix in prefixes:
        text = prefix + prompt
        p, t = encode_continuation(tokenizer, text, target)
        seqs.append(list(p) + list(t[:-1]))
        at.append(subject_last_index(tokenizer, text, subject))
        cols.append([len(p) - 1 + j for j in range(len(t))])
    kl_text = f"{subject} is a"
    seqs.append(encode_prompt(tokenizer, kl_text))
    at.append(subject_last_index(tokenizer, kl_text, subject))
    width = max(len(s) for s in seqs)
    shift = [width - len(s) for s in seqs]
    return _Batch(
        batch_inputs(seqs, pad_id(tokenizer), device),
        torch.tensor([a + s for a, s in zip(at, shift)], device=device),
        [[c + s for c in cs] for cs, s in zip(cols, shift)],
        list(t),
    )


def _logits_at(model: nn.Module, columns: list[int], device) -> tuple[dict, dict[int, int]]:
    """The forward keyword that limits the logits to ``columns`` where the model takes one
    (``logits_to_keep``), and where each column's logits then are."""
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        return {"logits_to_keep": torch.tensor(columns, device=device)}, {c: i for i, c in enumerate(columns)}
    return {}, {c: c for c in columns}


def optimize_value(
    model: nn.Module,
    tokenizer,
    prompt: str,
    subject: str,
    target: str,
    layer: int,
    prefixes: Sequence[str] = ("",),
    settings: ValueSettings = ValueSettings(),
) -> tuple[torch.Tensor, dict[str, float]]:
    """delta (d_out,) float32 on the CPU, and the first and last NLL and KL of the optimization."""
    device = model_device(model)
    b = _batch(tokenizer, prompt, subject, target, prefixes, device)
    rows = torch.arange(len(b.at), device=device)
    site = locate_down_proj(model, layer)
    box: dict = {"delta": None}

    def add_delta(module, args, out):
        box["h"] = out[rows, b.at].detach()
        if box["delta"] is None:
            return out
        out = out.clone()
        out[rows, b.at] = out[rows, b.at] + box["delta"].to(out.dtype)
        return out

    def read_residual(module, args, out):
        if box["delta"] is None:  # the unedited pass
            box["residual"] = (out[0] if isinstance(out, tuple) else out)[0, b.at[0]].detach()

    handle = site.module.register_forward_hook(add_delta)
    handle_residual = decoder_layers(model)[1][layer].register_forward_hook(read_residual)
    trainable = [q.requires_grad for q in model.parameters()]
    model.requires_grad_(False)  # only delta learns; the weights get no gradients
    try:
        kl_at = int(b.at[-1])  # the KL prompt's subject token, where ROME compares the distributions
        # only the columns the loss reads go through the output head (the rows are right-aligned, so
        # the target columns are shared); col maps a column of the sequence to one of the logits
        keep = sorted({c for cols in b.target_cols for c in cols} | {kl_at})
        extra, col = _logits_at(model, keep, device)
        with torch.no_grad():
            unedited = F.log_softmax(model(**b.inputs, **extra).logits[-1, col[kl_at]].float(), -1)
        # the clamp's and the decay's scale: the unedited state on the first prompt
        h_norm = (box["h"][0] if settings.norm_of == "mlp" else box["residual"]).float().norm()
        delta = torch.zeros(site.d_out, device=device, requires_grad=True)
        box["delta"] = delta
        opt = torch.optim.Adam([delta], lr=settings.lr)
        log: dict[str, float] = {}
        # as EasyEdit's compute_v: ``steps`` scored passes, an update after each but the last, an early
        # stop once the loss is below EARLY_STOP_LOSS; the last pass scored the delta returned
        for step in range(settings.steps):
            logp = F.log_softmax(model(**b.inputs, **extra).logits.float(), -1)
            nll = torch.stack(
                [-logp[r, [col[c] for c in cols], b.target_ids].mean() for r, cols in enumerate(b.target_cols)]
            ).mean()
            kl = F.kl_div(unedited, logp[-1, col[kl_at]], log_target=True, reduction="sum")  # KL(edited || unedited)
            loss = nll + settings.kl_weight * kl + settings.weight_decay * delta.norm() / h_norm**2
            if step == 0:
                log.update(nll_first=float(nll.detach()), kl_first=float(kl.detach()))
            log.update(nll_last=float(nll.detach()), kl_last=float(kl.detach()), steps=step + 1)
            if float(loss.detach()) < EARLY_STOP_LOSS or step == settings.steps - 1:
                break
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                cap = settings.clamp_factor * h_norm
                if delta.norm() > cap:
                    delta.mul_(cap / delta.norm())
    finally:
        handle.remove()
        handle_residual.remove()
        for q, flag in zip(model.parameters(), trainable):
            q.requires_grad_(flag)
    return delta.detach().float().cpu(), log


def cached_value(
    model: nn.Module,
    tokenizer,
    prompt: str,
    subject: str,
    target: str,
    layer: int,
    cache_dir: str | Path,
    prefixes: Sequence[str] = ("",),
    settings: ValueSettings = ValueSettings(),
) -> torch.Tensor:
    """:func:`optimize_value`, read from ``cache_dir`` when the same model layer, edit, prefixes and
    settings made it (each value costs tens of forward and backward passes)."""
    key = content_key(
        [
            VALUE_VERSION,
            weight_fingerprint(locate_down_proj(model, layer).weight()),
            layer,
            prompt,
            subject,
            target,
            list(prefixes),
            dataclasses.asdict(settings),
        ]
    )
    file = Path(cache_dir) / f"value-layer{layer}-{key}.safetensors"
    return cached_tensor(
        file, lambda: optimize_value(model, tokenizer, prompt, subject, target, layer, prefixes, settings)[0], "delta"
    )
