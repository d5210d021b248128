"""States computed with shared prefixes equal those of one plain pass per sequence."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from aloe_build.shared_prefix import collect_states_shared, prefix_groups
from aloe_build.states import collect_states


def _sequences(seed: int) -> list[list[int]]:
    """Groups of sequences with a common beginning (of 3 to 8 tokens), beside unrelated ones."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in torch.randint(3, 9, (5,), generator=g).tolist():
        head = torch.randint(5, 60, (n,), generator=g).tolist()
        for tail in torch.randint(1, 6, (4,), generator=g).tolist():
            out.append(head + torch.randint(5, 60, (tail,), generator=g).tolist())
    out += [torch.randint(5, 60, (n,), generator=g).tolist() for n in torch.randint(1, 9, (6,), generator=g)]
    out.append(out[0][:-1])  # a sequence that is a prefix of another one
    out.append(list(out[1]))  # and an exact duplicate
    perm = torch.randperm(len(out), generator=g).tolist()
    return [out[i] for i in perm]


def test_groups_share_their_prefix_and_leave_a_token_each():
    seqs = _sequences(0)
    groups = prefix_groups(seqs, min_shared=3)
    assert sorted(i for grp in groups for i in grp.members) == list(range(len(seqs)))
    assert any(grp.shared for grp in groups)
    for grp in groups:
        if grp.shared:
            assert grp.shared >= 3 and len(grp.members) > 1
            head = seqs[grp.members[0]][: grp.shared]
            assert all(seqs[i][: grp.shared] == head and len(seqs[i]) > grp.shared for i in grp.members)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
@pytest.mark.parametrize("batch_size", [1, 5, 64])
def test_shared_prefix_states_equal_plain_ones(family, batch_size):
    model, tok = tiny_model(family), tiny_tokenizer()
    seqs = _sequences(1)
    positions = [list(range(len(s) - 1, -1, -2)) for s in seqs]
    positions[2] = []  # a sequence with no position kept
    got = collect_states_shared(model, tok, seqs, 1, positions, batch_size)
    want = collect_states(model, tok, seqs, 1, positions, 7)
    assert torch.equal(got.offsets, want.offsets)
    torch.testing.assert_close(got.states, want.states, rtol=1e-5, atol=1e-5)
    every = collect_states_shared(model, tok, seqs, 2, None, batch_size)
    torch.testing.assert_close(every.states, collect_states(model, tok, seqs, 2, None, 7).states,
                               rtol=1e-5, atol=1e-5)
