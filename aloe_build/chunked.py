"""Long forward passes of a stage in fixed chunks of sequences, each saved as it finishes.

A stage over thousands of edits runs hundreds of thousands of sequences through the model;
split into chunks of :data:`CHUNK_SEQUENCES` (the same split whether or not a checkpoint
directory is given and however many processes build, so a resumed or distributed build computes
exactly what an uninterrupted one in one process does), each
chunk's result goes to the stage's :class:`~aloe_build.checkpoints.PartStore` and an
interrupted stage loses at most one chunk. One bar per pass counts sequences over all chunks,
advanced after every batch inside a chunk, so that its rate and the time left it shows follow
the work as it is done.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch
from tqdm.auto import tqdm

from aloe_kernels.hf import locate_down_proj

from . import distributed
from .checkpoints import PartStore
from .forward import Tick, generate_with_states
from .states import StateBatch
from .token_tree import PACK_TOKENS, TREES_PER_PASS, collect_states_tree
from .tokens import end_index, pad_id, stop_ids

#: Sequences per chunk: the unit that is saved, and that a distributed build deals out to its
#: processes. The same whatever the number of processes, so that each chunk is computed in the same
#: batches and N processes compute the very states one does: the refinement turns a change of 1e-6
#: in them into addresses 0.2 apart (docs/options.md, "Building large operators").
CHUNK_SEQUENCES = 256


#: Chunks each process of a distributed build computes between two exchanges of what they computed.
CHUNKS_PER_GATHER = 8


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + CHUNK_SEQUENCES)) for lo in range(0, n, CHUNK_SEQUENCES)]


def _pieces(
    parts: PartStore | None, name: str, n: int, desc: str, compute: Callable[[int, int, Tick], dict[str, torch.Tensor]]
) -> Iterator[tuple[int, int, dict[str, torch.Tensor]]]:
    """``(lo, hi, compute(lo, hi, tick))`` for each chunk of ``n`` items, read back from ``parts``
    where saved. The bar starts at the items already saved, so that its rate, and the time left it
    shows, come from the work of this run only; ``tick`` advances it within a chunk.

    In a distributed build the chunks not saved are dealt out to the ranks in turn; each rank
    computes (and saves) its own, and every rank receives all of them, gathered every
    :data:`CHUNKS_PER_GATHER` chunks of each rank (not after each: a rank that finished its chunk
    would wait for the others' each time). The chunks' size is part of their saved name: chunks of
    another size are recomputed, not misread."""
    chunks = _chunks(n)
    key = [f"{name}-of{CHUNK_SEQUENCES}-{c}" for c in range(len(chunks))]
    # rank 0's view of what is saved, for every rank: a rank that looked later could see more
    saved = distributed.from_main({c for c in range(len(chunks)) if parts is not None and parts.has(key[c])})
    done = sum(hi - lo for c, (lo, hi) in enumerate(chunks) if c in saved)
    with tqdm(total=n, initial=done, desc=desc, leave=False) as bar:

        def run(c: int) -> tuple[dict[str, torch.Tensor], bool]:
            lo, hi = chunks[c]
            ticked = [0]

            def tick(k: int) -> None:
                ticked[0] += k
                bar.update(k)

            if parts is None:
                piece, read_back = compute(lo, hi, tick), False
            else:
                piece, read_back = parts.cached(key[c], lambda: compute(lo, hi, tick))
            bar.update(0 if read_back else max(0, hi - lo - ticked[0]))
            return piece, read_back

        if not distributed.active():
            for c, (lo, hi) in enumerate(chunks):
                yield lo, hi, run(c)[0]
            return
        todo = [c for c in range(len(chunks)) if c not in saved]
        got: dict[int, dict[str, torch.Tensor]] = {}
        w, me = distributed.world_size(), distributed.rank()
        wave = w * CHUNKS_PER_GATHER
        for start in range(0, len(todo), wave):
            dealt = todo[start : start + wave]
            mine = {c: run(c)[0] for c in dealt[me::w]}
            for r, pieces in enumerate(distributed.gathered(mine)):
                got.update(pieces)
                if r != me:
                    bar.update(sum(chunks[c][1] - chunks[c][0] for c in pieces))
        for c, (lo, hi) in enumerate(chunks):
            yield lo, hi, got.pop(c) if c in got else run(c)[0]


def chunked_states(
    parts: PartStore | None,
    name: str,
    model,
    tokenizer,
    sequences: Sequence[Sequence[int]],
    layer: int,
    positions: Sequence[Sequence[int]] | None,
    desc: str,
    pack_tokens: int = PACK_TOKENS,
    trees_per_pass: int = TREES_PER_PASS,
) -> StateBatch:
    """:func:`aloe_build.states.collect_states` chunk by chunk, filling one preallocated result.

    The sequences are taken in sorted order, so that those with a common beginning fall in one
    chunk, where each distinct prefix runs once (:mod:`aloe_build.token_tree`, trees of
    ``pack_tokens`` nodes, ``trees_per_pass`` per forward pass)."""
    keep = [len(s) if positions is None else len(positions[i]) for i, s in enumerate(sequences)]
    offsets = torch.zeros(len(keep) + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(keep, dtype=torch.long), 0)
    states = torch.zeros(int(offsets[-1]), locate_down_proj(model, layer).d)
    order = sorted(range(len(sequences)), key=lambda i: tuple(sequences[i]))

    def compute(lo: int, hi: int, tick: Tick) -> dict[str, torch.Tensor]:
        idx = order[lo:hi]
        got = collect_states_tree(
            model,
            tokenizer,
            [sequences[i] for i in idx],
            layer,
            None if positions is None else [positions[i] for i in idx],
            pack_tokens,
            trees_per_pass,
            tick=tick,
        )
        return {"states": got.states}

    # the parts of the sorted order have their own name: chunks saved in another order are not read back
    for lo, hi, piece in _pieces(parts, f"{name}-sorted", len(sequences), desc, compute):
        at = 0
        for i in order[lo:hi]:
            rows = int(offsets[i + 1] - offsets[i])
            states[int(offsets[i]) : int(offsets[i + 1])] = piece["states"][at : at + rows]
            at += rows
    return StateBatch(states, offsets)


def chunked_tokens_and_states(
    parts: PartStore | None,
    name: str,
    n: int,
    compute: Callable[[int, int, Tick], tuple[list[list[int]], list[torch.Tensor]]],
    desc: str,
    d: int,
) -> tuple[list[list[int]], StateBatch]:
    """``compute(lo, hi, tick)`` (a list of ints for each of items lo..hi-1, such as its generated
    tokens, and a block of ``d``-dimensional states for each) chunk by chunk, each chunk saved;
    returns the lists and the states of all items in order."""

    def packed(lo: int, hi: int, tick: Tick) -> dict[str, torch.Tensor]:
        lists, states = compute(lo, hi, tick)
        return {
            "tokens": torch.tensor([t for xs in lists for t in xs], dtype=torch.long),
            "lengths": torch.tensor([len(xs) for xs in lists], dtype=torch.long),
            "states": torch.cat(states) if states else torch.zeros(0, d),
            "rows": torch.tensor([len(x) for x in states], dtype=torch.long),
        }

    out: list[list[int]] = []
    blocks: list[torch.Tensor] = []
    rows: list[torch.Tensor] = []
    for _lo, _hi, piece in _pieces(parts, name, n, desc, packed):
        flat = piece["tokens"].tolist()
        ends = piece["lengths"].cumsum(0).tolist()
        out += [flat[(ends[i - 1] if i else 0) : e] for i, e in enumerate(ends)]
        blocks.append(piece["states"])
        rows.append(piece["rows"])
    offsets = torch.zeros(n + 1, dtype=torch.long)
    if rows:
        offsets[1:] = torch.cat(rows).cumsum(0)
    return out, StateBatch(torch.cat(blocks) if blocks else torch.zeros(0, d), offsets)


#: Generation batches hold this many times ``batch_size`` prompts: a greedy step costs little more
#: for more rows, as its time goes to per-step overhead (docs/results.md, "Continuations").
GENERATION_BATCH_MULTIPLE = 4


def continued(
    model,
    tokenizer,
    prompts: list[list[int]],
    tokens: int,
    layer: int,
    batch_size: int,
    desc: str,
    parts: PartStore | None = None,
    name: str = "continuations",
    starts: Sequence[int] | None = None,
) -> tuple[list[list[int]], StateBatch]:
    """Each prompt followed by the unedited model's greedy continuation of up to ``tokens`` tokens,
    cut before its first stop token (EOS or end of turn, :func:`~aloe_build.tokens.stop_ids`: a
    server stops there and never feeds it back), and the
    normalized states of each continued sequence from position ``starts[i]`` (default: its first
    continuation token) to its end, taken while generating (:func:`generate_with_states`), in
    batches of ``batch_size * GENERATION_BATCH_MULTIPLE`` prompts."""
    stops = stop_ids(tokenizer)

    def generate(lo: int, hi: int, tick: Tick) -> tuple[list[list[int]], list[torch.Tensor]]:
        gens, states = generate_with_states(
            model,
            prompts[lo:hi],
            max(tokens, 0),
            layer,
            starts=None if starts is None else starts[lo:hi],
            pad_id=pad_id(tokenizer),
            batch_size=batch_size * GENERATION_BATCH_MULTIPLE,
            tick=tick,
        )
        kept = [g[: end_index(g, stops)] for g in gens]
        return kept, [st[: len(st) - (len(g) - len(k))] for st, g, k in zip(states, gens, kept)]

    gens, got = chunked_tokens_and_states(
        parts, f"{name}-with-states", len(prompts), generate, desc, locate_down_proj(model, layer).d
    )
    return [list(p) + g for p, g in zip(prompts, gens)], got
