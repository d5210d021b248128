"""The address-separability reading against a brute force over every pair, in float64."""

from __future__ import annotations

import torch

from benchmarks.address_separability import separability


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
    slots = {max(range(n), key=lambda i: max(r(loc[j], i) for j in range(31) if loc_prompt[j] == p))
             for p in range(prompts)}
    assert got["locality_max_slots_distinct"] == len(slots)
    assert got["rephrases"] == 11 and got["locality_prompts"] == prompts
