"""States collected in token trees (each distinct prefix once) equal those of one plain pass per sequence."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from aloe_build.states import collect_states
from aloe_build.token_tree import collect_states_tree, token_trees


def _sequences(seed: int) -> list[list[int]]:
    """Groups of sequences with a common beginning (of 3 to 8 tokens) and a common middle, beside
    unrelated ones, a sequence that is a prefix of another and an exact duplicate."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in torch.randint(3, 9, (5,), generator=g).tolist():
        head = torch.randint(5, 60, (n,), generator=g).tolist()
        middle = torch.randint(5, 60, (3,), generator=g).tolist()
        for tail in torch.randint(1, 6, (4,), generator=g).tolist():
            out.append(head + torch.randint(5, 60, (tail,), generator=g).tolist())
            out.append(head + middle + torch.randint(5, 60, (tail,), generator=g).tolist())
    out += [torch.randint(5, 60, (n,), generator=g).tolist() for n in torch.randint(1, 9, (6,), generator=g)]
    out.append(out[0][:-1])
    out.append(list(out[1]))
    perm = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in perm]


@pytest.mark.parametrize("pack", [1, 9, 40, 1000])
def test_trees_hold_every_sequence_once_and_each_prefix_once(pack):
    seqs = _sequences(0)
    trees = token_trees(seqs, pack)
    assert sorted(i for t in trees for i in t.members) == list(range(len(seqs)))
    for t in trees:
        # at most ``pack`` nodes, unless one sequence alone is longer
        assert len(t.tokens) <= max(pack, max(len(seqs[i]) for i in t.members))
        prefixes = set()
        for i, path in zip(t.members, t.nodes):
            assert [t.tokens[k] for k in path] == seqs[i]
            assert [t.depth[k] for k in path] == list(range(len(seqs[i])))
            assert all(t.parent[path[d]] == (path[d - 1] if d else -1) for d in range(len(path)))
            prefixes |= {tuple(seqs[i][: d + 1]) for d in range(len(seqs[i]))}
        assert len(t.tokens) == len(prefixes)  # no prefix twice within a tree
    if pack == 1000:  # one tree: the shared beginnings and middles ran once
        assert len(trees) == 1 and len(trees[0].tokens) < 0.7 * sum(len(s) for s in seqs)


def test_a_node_sees_exactly_its_ancestors():
    tree = token_trees([[5, 6, 7], [5, 6, 8], [5, 9]], 100)[0]
    sees = tree.ancestry()
    for a in range(len(tree.tokens)):
        chain, k = set(), a
        while k >= 0:
            chain.add(k)
            k = tree.parent[k]
        assert {b for b in range(len(tree.tokens)) if sees[a, b]} == chain


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("pack,per_pass", [(1, 1), (9, 3), (1000, 1)])
def test_tree_states_equal_plain_ones(family, attention, pack, per_pass):
    model, tok = tiny_model(family), tiny_tokenizer()
    model.set_attn_implementation(attention)
    seqs = _sequences(1)
    positions = [list(range(len(s) - 1, -1, -2)) for s in seqs]
    positions[2] = []  # a sequence with no position kept
    got = collect_states_tree(model, tok, seqs, 1, positions, pack, per_pass)
    want = collect_states(model, tok, seqs, 1, positions, 7)
    assert torch.equal(got.offsets, want.offsets)
    torch.testing.assert_close(got.states, want.states, rtol=1e-5, atol=1e-5)
    every = collect_states_tree(model, tok, seqs, 2, None, pack, per_pass)
    torch.testing.assert_close(every.states, collect_states(model, tok, seqs, 2, None, 7).states, rtol=1e-5, atol=1e-5)


def test_an_attention_without_custom_masks_runs_plain_passes(monkeypatch):
    import aloe_build.token_tree as token_tree

    model, tok = tiny_model("llama"), tiny_tokenizer()
    seqs = _sequences(2)
    monkeypatch.setattr(token_tree, "TREE_ATTENTION", ())  # as if this model's attention ignored custom masks
    monkeypatch.setattr(token_tree, "token_trees", lambda *a, **k: pytest.fail("trees built for that attention"))
    got = collect_states_tree(model, tok, seqs, 1)
    monkeypatch.undo()
    torch.testing.assert_close(got.states, collect_states(model, tok, seqs, 1, None, 7).states, rtol=1e-5, atol=1e-5)
