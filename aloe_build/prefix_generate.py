"""Greedy generation after one shared prefix: the prefix runs through the model once and its key-value
cache serves every prompt that starts with it.

Few-shot prompts (:mod:`.rewordings`) are mostly their shared examples; running those once instead of once
per prompt removes most of the prompt cost. The prompts' own tokens follow the prefix left-padded, the
padding in the middle masked out and the position ids continuing the prefix's, so each row computes what
the whole prompt run alone would, up to floating-point rounding.
"""

from __future__ import annotations

import copy
from typing import Callable, Sequence

import torch
from torch import nn

from .forward import batches, feed_tokens, model_device
from .tokens import left_pad

__all__ = ["generate_after_prefix"]


def generate_after_prefix(
    model: nn.Module,
    prefix: Sequence[int],
    suffixes: Sequence[Sequence[int]],
    max_tokens: int,
    *,
    pad_id: int,
    finished: Callable[[list[int]], bool] | None = None,
    batch_size: int = 32,
) -> list[list[int]]:
    """Greedy continuations of ``prefix + suffixes[i]``, at most ``max_tokens`` each.

    ``prefix`` must be non-empty and every suffix non-empty. ``finished(tokens)`` says whether a row's
    continuation so far is complete (say, a line ended): a batch stops once every row is, so rows may
    come back shorter than ``max_tokens``, and a row may run past its own end while the others finish.
    """
    if not prefix:
        raise ValueError("the shared prefix is empty: use greedy_generate")
    if any(not s for s in suffixes):
        raise ValueError("every prompt needs at least one token after the shared prefix")
    out: list[list[int]] = [[] for _ in suffixes]
    if not suffixes or max_tokens <= 0:
        return out
    device = model_device(model)
    width = len(prefix)
    order = sorted(range(len(suffixes)), key=lambda i: (len(suffixes[i]), i))
    with torch.inference_mode():
        shared = model(input_ids=torch.tensor([list(prefix)], device=device), use_cache=True).past_key_values
        for batch in batches(order, batch_size):
            cache = copy.deepcopy(shared)
            cache.batch_repeat_interleave(len(batch))
            ids, own_mask, own_pos = left_pad([suffixes[i] for i in batch], pad_id, device)
            mask = torch.cat([own_mask.new_ones((len(batch), width)), own_mask], dim=1)
            pos = own_pos + width
            res = model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            rows: list[list[int]] = [[] for _ in batch]
            for step in range(max_tokens):
                nxt = res.logits[:, -1].argmax(-1)
                for row, token in zip(rows, nxt.tolist()):
                    row.append(int(token))
                if step + 1 == max_tokens or (finished is not None and all(finished(r) for r in rows)):
                    break
                res, mask, pos = feed_tokens(model, nxt, mask, pos, res.past_key_values)
            for b, i in enumerate(batch):
                out[i] = rows[b]
    return out
