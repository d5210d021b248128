"""Stage 3 drops a continuation state that equals an anchor of its own prompt, comparing it with the
anchors of that prompt only."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from aloe_build.stages.s3_rollouts import not_anchors_of_prompt, prompt_ids


def _unit(rows: int, d: int, g: torch.Generator) -> torch.Tensor:
    return F.normalize(torch.randn(rows, d, generator=g), dim=1)


def test_drops_exactly_the_copies_of_an_anchor_of_the_same_prompt():
    g = torch.Generator().manual_seed(3)
    d, groups = 37, 7
    anchors = _unit(23, d, g)
    anchor_prompt = torch.randint(0, groups - 1, (23,), generator=g)  # group 6 has no anchor
    planted_same, planted_other, fresh = 9, 5, 30
    same_rows = torch.randint(0, 23, (planted_same,), generator=g)
    other_rows = torch.randint(0, 23, (planted_other,), generator=g)
    states = torch.cat(
        [
            # a copy as another batch layout would give it: equal up to float32 rounding
            F.normalize(anchors[same_rows] + 1e-7 * torch.randn(planted_same, d, generator=g), dim=1),
            anchors[other_rows],
            _unit(fresh, d, g),
        ]
    )
    state_prompt = torch.cat(
        [
            anchor_prompt[same_rows],
            (anchor_prompt[other_rows] + 1) % groups,  # the same state under another prompt
            torch.randint(0, groups, (fresh,), generator=g),
        ]
    )
    perm = torch.randperm(states.shape[0], generator=g)
    expected = torch.cat([torch.zeros(planted_same, dtype=torch.bool), torch.ones(planted_other + fresh, dtype=torch.bool)])
    keep = not_anchors_of_prompt(states[perm], state_prompt[perm], anchors, anchor_prompt)
    assert torch.equal(keep, expected[perm])


def test_no_states_or_no_anchors_keep_everything():
    g = torch.Generator().manual_seed(0)
    anchors = _unit(4, 8, g)

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.long)

    assert not_anchors_of_prompt(anchors[:0], zeros(0), anchors, zeros(4)).shape == (0,)
    assert not_anchors_of_prompt(anchors[:3], zeros(3), anchors[:0], zeros(0)).all()
    assert not not_anchors_of_prompt(anchors[:3], zeros(3), anchors, zeros(4)).any()


def test_prompt_ids_are_shared_across_lists():
    known: dict[tuple[int, ...], int] = {}
    first = prompt_ids([[1, 2], [3], [1, 2]], known)
    second = prompt_ids([[3], [4, 5], [1, 2]], known)
    assert first.tolist() == [0, 1, 0] and second.tolist() == [1, 2, 0]
    assert prompt_ids([], known).shape == (0,)
