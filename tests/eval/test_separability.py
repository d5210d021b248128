"""``aloe_eval.separability``: the address-separability readings against a brute force over every pair, in float64."""

from __future__ import annotations

import torch

from aloe_build.slots import SamePrompt
from aloe_eval.separability import separability


def test_separability_matches_a_brute_force():
    g = torch.Generator().manual_seed(5)
    n, d, prompts = 7, 13, 9
    V = torch.randn(n, d, generator=g, dtype=torch.float64)
    s_neg = torch.randn(n, generator=g, dtype=torch.float64)
    s_pos = s_neg + torch.rand(n, generator=g, dtype=torch.float64) * 3
    reph = torch.nn.functional.normalize(torch.randn(11, d, generator=g, dtype=torch.float64), dim=1)
    reph_slot = torch.randint(0, n, (11,), generator=g)
    loc = torch.nn.functional.normalize(torch.randn(31, d, generator=g, dtype=torch.float64), dim=1)
    loc_prompt = torch.cat([torch.arange(prompts), torch.randint(0, prompts, (22,), generator=g)])
    loc_prompt = loc_prompt[torch.randperm(31, generator=g)]
    got = separability(V, s_pos, s_neg, reph, reph_slot, loc, loc_prompt, prompts, chunk=4)

    def r(state, i):
        return float((state @ V[i] - s_neg[i]) / (s_pos[i] - s_neg[i]))

    own = [r(reph[k], int(reph_slot[k])) for k in range(11)]
    best = [max(r(loc[j], i) for j in range(31) if loc_prompt[j] == p for i in range(n)) for p in range(prompts)]
    wins = sum((a > b) + 0.5 * (a == b) for a in own for b in best)
    assert abs(got["auc_rephrase_over_locality"] - wins / (11 * prompts)) < 1e-12
    for cut in got["cuts"]:
        t = cut["t"]
        assert cut["rephrases_at_or_above"] == sum(a >= t for a in own) / 11
        assert cut["locality_below"] == sum(b < t for b in best) / prompts
    slots = {max(range(n), key=lambda i: max(r(loc[j], i) for j in range(31) if loc_prompt[j] == p)) for p in range(prompts)}
    assert got["locality_max_slots_distinct"] == len(slots)
    assert got["rephrases"] == 11 and got["locality_prompts"] == prompts


def test_stage_readings_and_negative_kinds_match_a_brute_force():
    """The ``--stages`` readings of unscaled addresses, and which negative kinds each slot's worst
    anchor clears, against loops over every pair in float64."""
    from aloe_eval.separability import clears_negatives, stage_readings

    g = torch.Generator().manual_seed(11)
    n, d, prompts = 5, 9, 6

    def unit(*shape):
        return torch.nn.functional.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)

    V = torch.randn(n, d, generator=g, dtype=torch.float64) * 3  # readings use the unit addresses
    requests, reph = unit(n, d), unit(8, d)
    reph_slot = torch.tensor([0, 1, 1, 2, 3, 4, 4, 0])
    loc_last, loc_slot = unit(prompts, d), torch.tensor([0, 1, 2, 3, 4, 4])
    loc = unit(15, d)
    loc_prompt = torch.cat([torch.arange(prompts), torch.randint(0, prompts, (9,), generator=g)])
    got = stage_readings(V, requests, reph, reph_slot, loc_last, loc_slot, loc, loc_prompt, prompts)
    Vu = V / V.norm(dim=1, keepdim=True)
    own = [float(reph[k] @ Vu[reph_slot[k]]) for k in range(8)]
    pairs = [
        (own[k], float(loc_last[j] @ Vu[loc_slot[j]])) for k in range(8) for j in range(prompts) if reph_slot[k] == loc_slot[j]
    ]
    assert abs(got["rewording_over_own_locality_prompt"] - sum(a > b for a, b in pairs) / len(pairs)) < 1e-12
    best = [max(float(loc[j] @ Vu[i]) for j in range(15) if loc_prompt[j] == p for i in range(n)) for p in range(prompts)]
    wins = sum((a > b) + 0.5 * (a == b) for a in own for b in best)
    assert abs(got["auc_rewording_over_locality_best"] - wins / (8 * prompts)) < 1e-12
    assert abs(got["mean_unit_score"]["request"] - sum(float(requests[i] @ Vu[i]) for i in range(n)) / n) < 1e-12

    # stage-3 states: anchors (owner per anchor), continuations, a pool, each slot's own negatives
    anchor_owner = torch.tensor([0, 0, 1, 2, 2, 3, 4, 4, 1])
    anchors = torch.nn.functional.normalize(Vu[anchor_owner] + 0.3 * unit(9, d), dim=1)  # near their slots
    specific = unit(10, d)
    specific[5] = Vu[3]  # slot 3's own edit negative lies on its address: it clears no kind but the others
    roll = {
        "anchors": anchors.float(),
        "anchor_owner": anchor_owner,
        "continuations": unit(7, d).float(),
        "continuation_owner": torch.tensor([0, 1, 2, 3, 4, 0, 2]),
        "pool": unit(6, d).float(),
        "specific": specific.float(),
        "specific_owner": torch.tensor([0, 0, 1, 1, 2, 3, 3, 4, 4, 4]),
    }
    same_prompt = SamePrompt(torch.arange(n), torch.arange(n))  # every slot its own prompt
    got = clears_negatives(V, roll, same_prompt)
    Vf = V.float()

    def worst_anchor(i):
        return min(float(roll["anchors"][a] @ Vf[i]) for a in range(9) if roll["anchor_owner"][a] == i)

    def worst(i, states, owner, own_only):
        scores = [float(states[j] @ Vf[i]) for j in range(len(states)) if (owner[j] == i if own_only else owner[j] != i)]
        return max(scores) if scores else float("-inf")

    minus = torch.full((6,), -1)
    kinds = {
        "pool": lambda i: worst(i, roll["pool"], minus, False),
        "other slots' anchors": lambda i: worst(i, roll["anchors"], roll["anchor_owner"], False),
        "continuations": lambda i: worst(i, roll["continuations"], roll["continuation_owner"], False),
        "own edit negatives": lambda i: worst(i, roll["specific"], roll["specific_owner"], True),
    }
    base = list(kinds.values())
    kinds["all"] = lambda i: max(f(i) for f in base)
    for name, f in kinds.items():
        assert abs(got[name] - sum(worst_anchor(i) > f(i) for i in range(n)) / n) < 1e-12, name
    assert 0 < got["all"] < 1 and got["own edit negatives"] < 1
