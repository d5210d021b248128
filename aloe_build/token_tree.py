"""States of many sequences with every distinct token prefix run through the model once.

Stage 3 asks for the states of tens of thousands of prompts, and most begin as others do: one subject
followed by many relations, one template followed by many subjects, one chat header before every
question. The state at a position of a causal model depends only on the tokens up to it, so two
sequences that share a prefix share its states. The sequences are taken in sorted order and packed
into token trees (a trie: one node per distinct prefix, at most :data:`PACK_TOKENS` nodes each).
A tree runs as one row of the model: each node at its depth as position id, under an attention mask
that lets a node see exactly its ancestors and itself, which is what each of its sequences' causal
masks would let it see. No token runs twice within a tree and no row is padded but the last of a
pass, where a shared-prefix cache left every pass padded to its longest rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from aloe_kernels.reading import reading_of, tree_running_sum

from .forward import Tick, capture_down_proj_input, model_device
from .states import StateBatch, collect_states, empty_states, normalize_rows, run_captured
from .tokens import pad_id

#: Nodes per tree. The mask makes a row's attention cost grow with the square of its length and its
#: linear layers only linearly; trees of 128 nodes, 4 per pass, ran fastest of 64-512 nodes and 1-16
#: per pass on SmolLM2's edit negatives (docs/results.md, "Each distinct prefix once: token trees").
PACK_TOKENS = 128

#: Trees per forward pass: one row of :data:`PACK_TOKENS` makes products too narrow to run efficiently.
TREES_PER_PASS = 4

#: Attention implementations that apply a custom additive 4D mask as given (flash attention does not).
TREE_ATTENTION = ("eager", "sdpa")

#: Sequences per pass where the model's attention cannot take a tree's mask (plain padded passes).
PLAIN_BATCH = 32


@dataclass
class TokenTree:
    """A trie over some sequences: node ``k`` holds ``tokens[k]`` at depth ``depth[k]`` below
    ``parent[k]`` (-1 for a first token); ``nodes[j]`` are the nodes along member ``j``."""

    tokens: list[int] = field(default_factory=list)
    parent: list[int] = field(default_factory=list)
    depth: list[int] = field(default_factory=list)
    members: list[int] = field(default_factory=list)
    nodes: list[list[int]] = field(default_factory=list)
    _child: dict[tuple[int, int], int] = field(default_factory=dict)

    def new_nodes(self, seq: Sequence[int]) -> int:
        """How many nodes ``seq`` would add."""
        at = -1
        for d, t in enumerate(seq):
            nxt = self._child.get((at, t))
            if nxt is None:
                return len(seq) - d
            at = nxt
        return 0

    def add(self, index: int, seq: Sequence[int]) -> None:
        at, path = -1, []
        for d, t in enumerate(seq):
            nxt = self._child.get((at, t))
            if nxt is None:
                nxt = len(self.tokens)
                self._child[(at, t)] = nxt
                self.tokens.append(t)
                self.parent.append(at)
                self.depth.append(d)
            path.append(nxt)
            at = nxt
        self.members.append(index)
        self.nodes.append(path)

    def ancestry(self) -> torch.Tensor:
        """(T, T) bool: ``[a, b]`` when node b is node a or one of its ancestors."""
        n = len(self.tokens)
        seen = torch.zeros(n, n, dtype=torch.bool)
        parent = torch.tensor(self.parent, dtype=torch.long)
        depth = torch.tensor(self.depth, dtype=torch.long)
        for d in range(int(depth.max()) + 1 if n else 0):
            at = (depth == d).nonzero().flatten()
            if d:
                seen[at] = seen[parent[at]]
            seen[at, at] = True
        return seen


def token_trees(sequences: Sequence[Sequence[int]], pack_tokens: int = PACK_TOKENS) -> list[TokenTree]:
    """The sequences in sorted order, packed greedily into trees of at most ``pack_tokens`` nodes
    (a longer sequence gets a tree of its own)."""
    order = sorted(range(len(sequences)), key=lambda i: tuple(sequences[i]))
    trees = [TokenTree()]
    for i in order:
        if trees[-1].members and len(trees[-1].tokens) + trees[-1].new_nodes(sequences[i]) > pack_tokens:
            trees.append(TokenTree())
        trees[-1].add(i, sequences[i])
    return [t for t in trees if t.members]


def _tree_inputs(trees: Sequence[TokenTree], pid: int, dtype: torch.dtype, device: torch.device) -> dict:
    """One row per tree, right-padded to the longest: ids, depths as position ids, and the additive
    4D mask (0 where a node sees another, the dtype's minimum elsewhere; a pad sees only itself)."""
    width = max(len(t.tokens) for t in trees)
    ids = torch.full((len(trees), width), pid, dtype=torch.long)
    pos = torch.zeros(len(trees), width, dtype=torch.long)
    sees = torch.eye(width, dtype=torch.bool).repeat(len(trees), 1, 1)
    for b, t in enumerate(trees):
        n = len(t.tokens)
        ids[b, :n] = torch.tensor(t.tokens, dtype=torch.long)
        pos[b, :n] = torch.tensor(t.depth, dtype=torch.long)
        sees[b, :n, :n] = t.ancestry()
    mask = torch.zeros(len(trees), 1, width, width, dtype=dtype)
    mask.masked_fill_(~sees[:, None], torch.finfo(dtype).min)
    return {"input_ids": ids.to(device), "position_ids": pos.to(device), "attention_mask": mask.to(device)}


def collect_states_tree(
    model: nn.Module,
    tokenizer,
    sequences: Sequence[Sequence[int]],
    layer: int,
    positions: Sequence[Sequence[int]] | None = None,
    pack_tokens: int = PACK_TOKENS,
    trees_per_pass: int = TREES_PER_PASS,
    desc: str | None = None,
    tick: Tick | None = None,
) -> StateBatch:
    """:func:`aloe_build.states.collect_states`, each distinct prefix computed once (``desc``: a
    progress bar over the passes; ``tick``: called with the sequences each pass finished). A model
    whose attention ignores custom masks runs plain padded passes instead."""
    if getattr(getattr(model, "config", None), "_attn_implementation", "eager") not in TREE_ATTENTION:
        return collect_states(model, tokenizer, sequences, layer, positions, PLAIN_BATCH, desc, tick)
    keep, out = empty_states(model, layer, sequences, positions)
    states, offsets = out.states, out.offsets
    nonempty = [i for i, s in enumerate(sequences) if len(s)]
    trees = token_trees([sequences[i] for i in nonempty], pack_tokens)
    # trees of similar size share a pass (little padding)
    trees.sort(key=lambda t: len(t.tokens))
    device, pid = model_device(model), pad_id(tokenizer)
    dtype = next(model.parameters()).dtype
    reading = reading_of(model)
    # a row of a pass is a tree, not a sequence: a running reading follows each node's ancestors
    with capture_down_proj_input(model, layer, raw=True) as box:
        for start in tqdm(range(0, len(trees), trees_per_pass), desc=desc, disable=desc is None, leave=False):
            batch = trees[start : start + trees_per_pass]
            h = run_captured(model, box, **_tree_inputs(batch, pid, dtype, device))
            for b, t in enumerate(batch):
                if reading is not None:
                    h[b, : len(t.tokens)] = tree_running_sum(h[b, : len(t.tokens)], t.parent, t.depth, reading.decay).to(h.dtype)
                for j, path in zip(t.members, t.nodes):
                    i = nonempty[j]
                    if keep[i]:
                        at = torch.tensor([path[p] for p in keep[i]], dtype=torch.long, device=device)
                        states[int(offsets[i]) : int(offsets[i + 1])] = normalize_rows(h[b, at]).cpu()
            if tick is not None:
                tick(sum(len(t.members) for t in batch))
    return out
