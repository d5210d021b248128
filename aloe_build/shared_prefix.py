"""Keys and values of prefixes computed once and continued by many rows.

The write stages (:mod:`aloe_build.edited_forward`) run the layers above the edited one on each
sequence's positions after its first open gate, on a cache of the positions before it: the cache of
a batch is built from each row's own keys and values, right-aligned.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def cache_layer_kv(cache: DynamicCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values (B, heads, T, dim) of one layer (transformers 5 keeps them per layer object)."""
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


def left_padded_cache(rows: list[list[tuple[torch.Tensor, torch.Tensor]]], width: int, device: torch.device) -> DynamicCache:
    """A cache of ``len(rows)`` rows from each row's per-layer keys and values (heads, length, dim),
    right-aligned in ``width`` positions (an empty list: a row with none); the attention mask must
    leave out the positions before each row's own."""
    some = next(r for r in rows if r)
    cache = DynamicCache()
    for j, (k0, v0) in enumerate(some):
        keys = torch.zeros(len(rows), k0.shape[0], width, k0.shape[2], device=device, dtype=k0.dtype)
        values = torch.zeros(len(rows), v0.shape[0], width, v0.shape[2], device=device, dtype=v0.dtype)
        for b, row in enumerate(rows):
            if row:
                k, v = row[j]
                keys[b, :, width - k.shape[1] :] = k.to(device)
                values[b, :, width - v.shape[1] :] = v.to(device)
        cache.update(keys, values, j)
    return cache
