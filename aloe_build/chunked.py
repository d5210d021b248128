"""Long forward passes of a stage in fixed chunks of sequences, each saved as it finishes.

A stage over thousands of edits runs hundreds of thousands of sequences through the model;
split into chunks of :data:`CHUNK_SEQUENCES` (the same split whether or not a checkpoint
directory is given, so a resumed build computes exactly what an uninterrupted one does), each
chunk's result goes to the stage's :class:`~aloe_build.checkpoints.PartStore` and an
interrupted stage loses at most one chunk. One bar per pass counts sequences over all chunks.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
from tqdm.auto import tqdm

from .checkpoints import PartStore
from .states import StateBatch, collect_states

#: Sequences per saved chunk: a few minutes of work on two CPU cores.
CHUNK_SEQUENCES = 2048


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + CHUNK_SEQUENCES)) for lo in range(0, n, CHUNK_SEQUENCES)]


def _bar(parts: PartStore | None, name: str, n: int, desc: str) -> tqdm:
    """A bar over ``n`` items that starts at the items of chunks already saved, so that its rate,
    and the time left it shows, come from the chunks computed in this run only."""
    done = sum(hi - lo for c, (lo, hi) in enumerate(_chunks(n)) if parts is not None and parts.has(f"{name}-{c}"))
    return tqdm(total=n, initial=done, desc=desc, leave=False)


def chunked_states(parts: PartStore | None, name: str, model, tokenizer, sequences: Sequence[Sequence[int]],
                   layer: int, positions: Sequence[Sequence[int]] | None, batch_size: int, desc: str) -> StateBatch:
    """:func:`aloe_build.states.collect_states` chunk by chunk, filling one preallocated result."""
    keep = [len(s) if positions is None else len(positions[i]) for i, s in enumerate(sequences)]
    offsets = torch.zeros(len(keep) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(keep, dtype=torch.long), 0)
    states: torch.Tensor | None = None
    with _bar(parts, name, len(sequences), desc) as bar:
        for c, (lo, hi) in enumerate(_chunks(len(sequences))):
            read_back = parts is not None and parts.has(f"{name}-{c}")
            def compute(lo=lo, hi=hi) -> dict[str, torch.Tensor]:
                got = collect_states(model, tokenizer, sequences[lo:hi], layer,
                                     None if positions is None else positions[lo:hi], batch_size)
                return {"states": got.states}

            piece = parts.cached(f"{name}-{c}", compute)[0] if parts is not None else compute()
            if states is None:
                states = torch.zeros(int(offsets[-1]), piece["states"].shape[1])
            states[int(offsets[lo]): int(offsets[hi])] = piece["states"]
            bar.update(0 if read_back else hi - lo)
    if states is None:  # no sequence at all
        from aloe_kernels.hf import locate_down_proj

        states = torch.zeros(0, locate_down_proj(model, layer).d)
    return StateBatch(states, offsets)


def chunked_token_lists(parts: PartStore | None, name: str, n: int,
                        compute: Callable[[int, int], list[list[int]]], desc: str) -> list[list[int]]:
    """``compute(lo, hi)`` (token lists of items lo..hi-1) chunk by chunk, each chunk saved."""
    out: list[list[int]] = []
    with _bar(parts, name, n, desc) as bar:
        for c, (lo, hi) in enumerate(_chunks(n)):
            read_back = parts is not None and parts.has(f"{name}-{c}")
            def run(lo=lo, hi=hi) -> dict[str, torch.Tensor]:
                lists = compute(lo, hi)
                flat = [t for xs in lists for t in xs]
                return {"tokens": torch.tensor(flat, dtype=torch.long),
                        "lengths": torch.tensor([len(xs) for xs in lists], dtype=torch.long)}

            piece = parts.cached(f"{name}-{c}", run)[0] if parts is not None else run()
            flat = piece["tokens"].tolist()
            ends = piece["lengths"].cumsum(0).tolist()
            out += [flat[(ends[i - 1] if i else 0): e] for i, e in enumerate(ends)]
            bar.update(0 if read_back else hi - lo)
    return out
