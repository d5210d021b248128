"""Second moment C = E[k k^T] of an MLP down-projection's input over every token of local text:
the covariance ROME, MEMIT and AlphaEdit use to keep an update off the keys a layer usually sees.

The text must never be an evaluated stream (the bundled construction corpus serves). The result is
cached per edited weight, layer and text, so MEMIT's layers and later runs read it back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from aloe_build.checkpoints import cached_tensor
from aloe_build.tokens import encode_prompt
from aloe_kernels import weight_fingerprint
from aloe_kernels.hf import locate_down_proj

from ..content_key import content_key
from .layer_inputs import down_proj_inputs


@torch.no_grad()
def second_moment(model: nn.Module, tokenizer, texts: Sequence[str], layer: int, batch_size: int = 16) -> torch.Tensor:
    """E[k k^T] over every token position of ``texts`` (BOS included where the tokenizer adds it),
    (d, d) in float64, accumulated a batch at a time."""
    seqs = [encode_prompt(tokenizer, t) for t in texts if t.strip()]
    if not seqs:
        raise ValueError("second_moment needs at least one non-empty text")
    total, count = None, 0
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        rows = down_proj_inputs(model, tokenizer, chunk, [range(len(s)) for s in chunk], layer, batch_size)
        k = torch.cat(rows).double()
        total = k.T @ k if total is None else total + k.T @ k
        count += k.shape[0]
    return total / count


def cached_second_moment(
    model: nn.Module, tokenizer, texts: Sequence[str], layer: int, cache_dir: str | Path, batch_size: int = 16
) -> torch.Tensor:
    """:func:`second_moment`, read from ``cache_dir`` when the same weight, layer and texts made it."""
    fingerprint = weight_fingerprint(locate_down_proj(model, layer).weight())
    key = content_key([fingerprint, layer, list(texts)])
    file = Path(cache_dir) / f"second-moment-layer{layer}-{key}.safetensors"
    return cached_tensor(file, lambda: second_moment(model, tokenizer, texts, layer, batch_size), "C")
