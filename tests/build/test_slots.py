"""Slots and which of them share a prompt."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from aloe_build.data import EditRequest
from aloe_build.slots import SamePrompt, make_slots


def test_same_prompt_is_pairwise_prompt_equality():
    rng = random.Random(3)
    prompts = [f"prompt {rng.randrange(7)}" for _ in range(53)]  # repeats, in no order
    same = SamePrompt.of([SimpleNamespace(prompt=p) for p in prompts])
    got = same.matrix()
    assert got.dtype == torch.bool and got.shape == (53, 53)
    for i, a in enumerate(prompts):
        for j, b in enumerate(prompts):
            assert bool(got[i, j]) == (a == b)
    assert SamePrompt.of([]).matrix().shape == (0, 0)


def test_same_prompt_rows_against_columns():
    """Rows taken by index (a chunk, a share) against any columns: the block of the whole matrix."""
    rng = random.Random(5)
    prompts = [f"p{rng.randrange(4)}" for _ in range(17)]
    same = SamePrompt.of([SimpleNamespace(prompt=p) for p in prompts])
    rows, cols = torch.tensor([16, 0, 3, 3]), torch.tensor([2, 9, 9, 0, 15])
    want = [[prompts[i] == prompts[j] for j in cols.tolist()] for i in rows.tolist()]
    assert same[rows].against(cols).tolist() == want
    assert same[3:6].matrix().tolist() == [[prompts[i] == b for b in prompts] for i in range(3, 6)]


def test_slots_with_one_prompt_and_two_targets_share_it():
    reqs = [
        EditRequest("The capital of France is", "Rome", "France"),
        EditRequest("The capital of France is", "Lyon", "France"),
        EditRequest("John Lennon plays the", "guitar", "John Lennon"),
        EditRequest("The capital of France is", "Rome", "France", id="again"),
    ]
    slots = make_slots(reqs)
    assert [s.ids for s in slots] == [["edit-0", "again"], ["edit-1"], ["edit-2"]]
    assert SamePrompt.of(slots).matrix().tolist() == [[True, True, False], [True, True, False], [False, False, True]]
