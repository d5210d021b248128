"""The loop of a WISE fit over a stream: each edit trained in turn on the side memory, shards saved every
``save_freq`` edits and merged every ``merge_freq``, the state checkpointed as it goes."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from aloe_build.forward import model_device, progress_bar
from aloe_kernels.hf import locate_down_proj

from .wise_checkpoint import WiseCheckpoint, WiseState
from .wise_inputs import edit_batch
from .wise_merge import ties_merge
from .wise_router import WiseDownProj
from .wise_train import UpperForward, train_edit

__all__ = ["after_edit", "run_fit", "shard_mask"]


def shard_mask(numel: int, ratio: float, seed: int, shard: int) -> torch.Tensor:
    """The gradient mask of one shard: 1 at a random ``ratio`` of the entries (Bernoulli), else 0."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + shard)
    return (torch.rand(numel, generator=gen) < ratio).float()


def run_fit(
    model: nn.Module,
    tokenizer,
    requests: Sequence[Any],
    layer: int,
    cfg: Any,
    state: WiseState,
    prefixes: list[str],
    unrelated: list[str],
    act: Callable[[torch.Tensor], torch.Tensor],
    saves: WiseCheckpoint,
    checkpoint_every: int,
    progress: bool,
) -> bool:
    """Train the edits of ``requests`` from ``state.done`` on, updating ``state`` (``cfg``: a
    :class:`.wise.WiseConfig`); the model is left unpatched. Returns whether the lower layers were run
    once per edit (:class:`.wise_train.UpperForward`)."""
    site = locate_down_proj(model, layer)
    device = model_device(model)
    main = site.weight().detach().float().clone()
    wrapper = WiseDownProj(site.module, state.side.to(device), float("inf"), [], [], act, cfg.long_sequence)
    setattr(site.parent, site.attr, wrapper)
    trainable = [p.requires_grad for p in model.parameters()]
    model.requires_grad_(False)
    upper = UpperForward(model, layer)
    checked = False
    mask, mask_shard = None, -1
    bar = progress_bar(len(requests), "WISE edits", progress)
    bar.update(state.done)
    try:
        for k in range(state.done, len(requests)):
            if k // cfg.save_freq != mask_shard:  # a fresh random mask for every shard
                mask_shard = k // cfg.save_freq
                mask = shard_mask(main.numel(), cfg.mask_ratio, cfg.seed, mask_shard).to(device)
            r = requests[k]
            batch = edit_batch(tokenizer, r.prompt, r.target_new, unrelated[k], prefixes, device)
            upper.prepare(batch.inputs())
            if not checked:  # once per fit: does the pass from the layer up give the full pass's logits?
                upper.check(batch.keep)
                checked = True
            wrapper.side = state.side.to(device)
            record = train_edit(lambda: upper(batch.keep, batch.n_in_scope), wrapper, batch, mask, main.to(device), cfg)
            state.side = wrapper.side.detach().float().cpu()
            after_edit(state, record, main, cfg)
            if (k + 1) % max(1, checkpoint_every) == 0 or k + 1 == len(requests):
                saves.save(state)
            bar.update(1)
    finally:
        bar.close()
        setattr(site.parent, site.attr, wrapper.base)
        for p, flag in zip(model.parameters(), trainable):
            p.requires_grad_(flag)
    return upper.enabled


def after_edit(state: WiseState, record: dict[str, Any], main: torch.Tensor, cfg: Any) -> None:
    """Book one trained edit into ``state``: its score into the side memory's minimum, then, on the
    ``save_freq``-th edit, the side memory saved as a shard (a copy of ``main`` takes the next edits),
    and on the ``merge_freq``-th the last ``merge_freq / save_freq`` shards merged by TIES."""
    state.side_min = min(state.side_min, record["score"])
    state.log.append(record)
    state.done += 1
    if state.done % cfg.save_freq == 0:
        state.memories.append(state.side.clone())
        state.memory_mins.append(state.side_min)
        state.side, state.side_min = main.clone(), float("inf")
    if state.done % cfg.merge_freq == 0:
        n = cfg.merge_freq // cfg.save_freq
        merged = ties_merge(main, state.memories[-n:], [cfg.merge_weight / n] * n, cfg.density)
        low = min(state.memory_mins[-n:])
        del state.memories[-n:], state.memory_mins[-n:]
        state.memories.append(merged)
        state.memory_mins.append(low)
