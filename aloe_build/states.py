"""Hidden states at the input of the edited down-projection.

The input of layer L's down-projection at position t depends only on tokens
0..t: an edit added to layer L's output changes later layers, never this
state. So the states an edited model passes through while it generates the
new target are the states of the teacher-forced sequence prompt + target,
and they can be collected once, before any write exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from aloe_kernels.hf import locate_down_proj
from aloe_kernels.reference import normalize_rows

from .forward import StopForward, Tick, capture_down_proj_input, model_device
from .tokens import batch_inputs, encode_prompt, pad_id


def run_captured(model: nn.Module, box: dict, cache=None, **inputs) -> torch.Tensor:
    """Run the model until the capture hook fires; returns the captured (B, T, d) input. With
    ``cache`` (a transformers ``Cache``) the pass continues it and adds its keys and values to it,
    up to the edited layer."""
    box.pop("h", None)
    try:
        with torch.no_grad():
            model(**inputs, past_key_values=cache, use_cache=cache is not None)
    except StopForward:
        pass
    if "h" not in box:
        raise RuntimeError("the down-projection of the edited layer was not reached in the forward pass")
    return box["h"]


def max_context(model: nn.Module, tokenizer) -> int:
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    tok_limit = getattr(tokenizer, "model_max_length", None)
    candidates = [x for x in (limit, tok_limit) if isinstance(x, int) and 0 < x < 10**8]
    return min(candidates) if candidates else 2048


@dataclass
class StateBatch:
    """Normalized states of many sequences, flattened: ``states[offsets[i]:offsets[i+1]]`` belong to sequence i."""

    states: torch.Tensor  # (N, d) float32, unit rows (zero rows stay zero)
    offsets: torch.Tensor  # (num_sequences + 1,) long

    def of(self, i: int) -> torch.Tensor:
        return self.states[int(self.offsets[i]) : int(self.offsets[i + 1])]

    def owner(self) -> torch.Tensor:
        """For every state row, the index of its sequence."""
        counts = self.offsets[1:] - self.offsets[:-1]
        return torch.repeat_interleave(torch.arange(len(counts)), counts)


def empty_states(
    model: nn.Module, layer: int, sequences: Sequence[Sequence[int]], positions: Sequence[Sequence[int]] | None
) -> tuple[list[list[int]], StateBatch]:
    """The positions kept of each sequence (every one where ``positions`` is None) and a zero
    :class:`StateBatch` laid out for them, to be filled in place: collecting per-sequence pieces and
    concatenating would need twice the memory."""
    keep = [list(range(len(seq))) if positions is None else list(positions[i]) for i, seq in enumerate(sequences)]
    offsets = torch.zeros(len(keep) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor([len(k) for k in keep], dtype=torch.long), 0)
    return keep, StateBatch(torch.zeros(int(offsets[-1]), locate_down_proj(model, layer).d), offsets)


def collect_states(
    model: nn.Module,
    tokenizer,
    sequences: Sequence[Sequence[int]],
    layer: int,
    positions: Sequence[Sequence[int]] | None = None,
    batch_size: int = 32,
    desc: str | None = None,
    tick: Tick | None = None,
    normalize: bool = True,
) -> StateBatch:
    """Normalized down-projection inputs at layer ``layer`` for token id sequences.

    ``positions[i]`` lists the positions of sequence i to keep (0-based, in the
    unpadded sequence); None keeps every position. ``tick``, if given, is called after
    each batch with the number of sequences it finished (an outer progress bar). With
    ``normalize`` false the inputs are kept raw, as a weight multiplies them (the weight
    editors' keys), in float32.
    """
    device = model_device(model)
    pid = pad_id(tokenizer)
    keep, out = empty_states(model, layer, sequences, positions)
    states, offsets = out.states, out.offsets
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))  # similar lengths share a batch
    with capture_down_proj_input(model, layer) as box:
        for start in tqdm(range(0, len(order), batch_size), desc=desc, disable=desc is None, leave=False):
            idx = order[start : start + batch_size]
            inputs = batch_inputs([sequences[i] for i in idx], pid, device)
            h = run_captured(model, box, **inputs)
            width = inputs["input_ids"].shape[1]
            for row, i in enumerate(idx):
                n = len(sequences[i])
                cols = torch.tensor([width - n + p for p in keep[i]], dtype=torch.long, device=h.device)
                rows = h[row].index_select(0, cols)
                states[int(offsets[i]) : int(offsets[i + 1])] = (normalize_rows(rows) if normalize else rows).cpu()
            if tick is not None:
                tick(len(idx))
    return out


def last_token_states(
    model, tokenizer, texts: Sequence[str], layer: int, batch_size: int = 32, desc: str | None = None
) -> torch.Tensor:
    """Normalized state at the last token of each text, (len(texts), d)."""
    seqs = [encode_prompt(tokenizer, t) for t in texts]
    return collect_states(model, tokenizer, seqs, layer, [[len(s) - 1] for s in seqs], batch_size, desc).states
