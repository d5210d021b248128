"""Slots and which of them share a prompt."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from aloe_build.data import EditRequest
from aloe_build.slots import make_slots, same_prompt_matrix


def test_same_prompt_matrix_is_pairwise_prompt_equality():
    rng = random.Random(3)
    prompts = [f"prompt {rng.randrange(7)}" for _ in range(53)]  # repeats, in no order
    items = [SimpleNamespace(prompt=p) for p in prompts]
    got = same_prompt_matrix(items)
    assert got.dtype == torch.bool and got.shape == (53, 53)
    for i, a in enumerate(prompts):
        for j, b in enumerate(prompts):
            assert bool(got[i, j]) == (a == b)
    assert same_prompt_matrix([]).shape == (0, 0)


def test_slots_with_one_prompt_and_two_targets_share_it():
    reqs = [
        EditRequest("The capital of France is", "Rome", "France"),
        EditRequest("The capital of France is", "Lyon", "France"),
        EditRequest("John Lennon plays the", "guitar", "John Lennon"),
        EditRequest("The capital of France is", "Rome", "France", id="again"),
    ]
    slots = make_slots(reqs)
    assert [s.ids for s in slots] == [["edit-0", "again"], ["edit-1"], ["edit-2"]]
    assert same_prompt_matrix(slots).tolist() == [[True, True, False], [True, True, False], [False, False, True]]
