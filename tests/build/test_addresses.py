"""Stages 4, 5 and 7 and the encoder on synthetic states: refinement, calibration, the ridge solve."""

from __future__ import annotations

import math

import pytest
import torch

from aloe_build import slot_sets
from aloe_build.config import BuildConfig
from aloe_build.slots import SamePrompt
from aloe_build.stages import s4_refine as addr
from aloe_build.stages import s5_calibrate as calibration
from aloe_build.stages.s1_encoder import CorpusStates, train_encoder
from aloe_build.stages.s7_ridge import NegativeGateTally, gates_of, ridge_writes
from aloe_kernels import AloeOperator


def _unit(x):
    return torch.nn.functional.normalize(x, dim=-1)


def _synthetic(n=6, d=24, anchors_per=3, negs=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = _unit(torch.randn(n, d, generator=g))
    anchors = _unit(centers.repeat_interleave(anchors_per, 0) + 0.15 * torch.randn(n * anchors_per, d, generator=g))
    owner = torch.arange(n).repeat_interleave(anchors_per)
    pool = _unit(torch.randn(negs, d, generator=g))
    neg = slot_sets.NegativeSet(
        shared=torch.cat([pool, anchors]),
        shared_owner=torch.cat([torch.full((negs,), -1), owner]),
        specific=_unit(centers + 0.9 * torch.randn(n, d, generator=g)),
        specific_owner=torch.arange(n),
    )
    V0 = 3.0 * _unit(centers + 0.8 * torch.randn(n, d, generator=g))  # a poor initial guess
    return V0, anchors, owner, neg, _own_prompts(n)


def _own_prompts(n: int) -> SamePrompt:
    """Every slot with a prompt of its own."""
    return SamePrompt(torch.arange(n), torch.arange(n))


def test_negative_top_matches_brute_force():
    """NegativeSet.top against a per-slot brute force: specific states in shuffled owner order, a
    slot with none, anchors of the slot itself and of a same-prompt slot excluded."""
    g = torch.Generator().manual_seed(3)
    n, d, k = 5, 16, 4
    V = torch.randn(n, d, generator=g)
    shared = _unit(torch.randn(40, d, generator=g))
    shared_owner = torch.cat([torch.full((30,), -1), torch.arange(n).repeat(2)])
    specific = _unit(torch.randn(23, d, generator=g))
    specific_owner = torch.tensor([0, 2, 4, 1] * 5 + [2, 0, 4])[torch.randperm(23, generator=g)]  # slot 3 has none
    prompt = torch.tensor([0, 0, 2, 3, 4])  # slots 0 and 1 share a prompt
    same = SamePrompt(prompt, prompt)
    negatives = slot_sets.NegativeSet(shared, shared_owner, specific, specific_owner)
    got_s, got_h = negatives.top(V, same, k, chunk=2)
    # read in pieces of 7 states (as from another device): the same hardest negatives
    streamed_s, streamed_h = negatives.top(V, same, k, chunk=2, stream_rows=7)
    torch.testing.assert_close(streamed_s, got_s)
    torch.testing.assert_close(streamed_h, got_h)
    for i in range(n):
        ok = (shared_owner < 0) | (prompt[shared_owner.clamp_min(0)] != prompt[i])
        cand = torch.cat([shared[ok], specific[specific_owner == i]])
        want = (cand @ V[i]).topk(k).values
        torch.testing.assert_close(got_s[i], want)
        torch.testing.assert_close(got_h[i] @ V[i], want)


def test_negative_top_from_candidates_matches_a_brute_force_over_them():
    """shared_candidates keeps each slot's best shared negatives (-1 past those it has); top with
    them scores only those and the slot's specific states, and with candidates covering every shared
    state it is the full top. A slot with fewer negatives than k gets -inf and zero states."""
    g = torch.Generator().manual_seed(11)
    n, d, k = 6, 10, 5
    V = torch.randn(n, d, generator=g, dtype=torch.float64)
    shared = _unit(torch.randn(37, d, generator=g, dtype=torch.float64))
    shared_owner = torch.cat([torch.full((25,), -1), torch.arange(n).repeat(2)])
    specific = _unit(torch.randn(19, d, generator=g, dtype=torch.float64))
    specific_owner = torch.tensor([0, 1, 2, 4] * 4 + [0, 1, 4])[torch.randperm(19, generator=g)]  # 3, 5: none
    same = _own_prompts(n)
    negatives = slot_sets.NegativeSet(shared, shared_owner, specific, specific_owner)
    cand_s, cand = negatives.shared_candidates(V, same, 7, chunk=4, stream_rows=9)
    torch.testing.assert_close(cand_s, torch.stack([(shared[c] @ v) for c, v in zip(cand.clamp_min(0), V)]))
    W = V + 0.5 * torch.randn(n, d, generator=g, dtype=torch.float64)  # the addresses have moved since
    got_s, got_h = negatives.top(W, same, k, candidates=cand)
    for i in range(n):
        ok = (shared_owner < 0) | (shared_owner != i)
        best7 = torch.nonzero(ok).squeeze(1)[(shared[ok] @ V[i]).topk(7).indices]
        assert set(cand[i].tolist()) == set(best7.tolist())
        pool = torch.cat([shared[best7], specific[specific_owner == i]])
        want = (pool @ W[i]).topk(k).values
        torch.testing.assert_close(got_s[i], want)
        torch.testing.assert_close(got_h[i] @ W[i], want)
    every = negatives.shared_candidates(V, same, 40)[1]
    assert ((every >= 0).sum(1) == 35).all() and (every[:, 35:] == -1).all()
    full_s, full_h = negatives.top(W, same, k)
    via_s, via_h = negatives.top(W, same, k, candidates=every)
    torch.testing.assert_close(via_s, full_s)
    torch.testing.assert_close(via_h, full_h)
    few = slot_sets.NegativeSet(shared[:0], shared_owner[:0], specific, specific_owner)
    few_s, few_h = few.top(W, same, k)
    assert (few_s[3] == -math.inf).all() and (few_h[3] == 0).all()
    mine = specific[specific_owner == 2]  # four states
    torch.testing.assert_close(few_s[2, :4], (mine @ W[2]).topk(4).values)
    assert few_s[2, 4] == -math.inf and (few_h[2, 4] == 0).all()


def test_min_anchor_scores_over_many_pieces_match_a_brute_force():
    """More anchors than one piece of rows holds (5,000 > 2,048): every slot's lowest anchor score,
    +inf for a slot with none, and the gradient of that minimum (the minimising anchor itself)."""
    g = torch.Generator().manual_seed(7)
    n, m, d = 9, 5000, 12
    V = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    anchors = torch.randn(m, d, generator=g, dtype=torch.float64)
    owner = torch.randint(0, n - 1, (m,), generator=g)  # slot n-1 has no anchors
    got = slot_sets.min_anchor_scores(V, anchors, owner)
    want = torch.stack(
        [
            (anchors[owner == i] @ V[i].detach()).min() if (owner == i).any() else torch.tensor(math.inf, dtype=torch.float64)
            for i in range(n)
        ]
    )
    torch.testing.assert_close(got.detach(), want)
    got[:-1].sum().backward()
    for i in range(n - 1):
        mine = anchors[owner == i]
        torch.testing.assert_close(V.grad[i], mine[(mine @ V[i].detach()).argmin()])
    assert torch.equal(V.grad[-1], torch.zeros(d, dtype=torch.float64))


def test_slot_anchors_of_a_subset_and_ties():
    """The anchors of a subset (``rows``), slots with one to many anchors interleaved, and two
    anchors of equal score: the minimum against a float64 brute force, the gradient through the
    first of equals."""
    g = torch.Generator().manual_seed(11)
    n, m, d = 6, 40, 7
    V = torch.randn(n, d, generator=g, dtype=torch.float64, requires_grad=True)
    anchors = torch.randn(m, d, generator=g, dtype=torch.float64)
    anchors[30] = anchors[12]  # a duplicate state: the same score at one slot
    rows = torch.tensor([3, 12, 30, 5, 7, 8, 9, 20, 21, 1])
    owner = torch.tensor([0, 2, 2, 4, 4, 4, 4, 0, 1, 0])  # slots 3 and 5 have none
    got = slot_sets.SlotAnchors(anchors, owner, n, rows).min_scores(V)
    sub = anchors[rows]
    want = [(sub[owner == i] @ V[i].detach()).min() if (owner == i).any() else math.inf for i in range(n)]
    torch.testing.assert_close(got.detach(), torch.tensor(want, dtype=torch.float64))
    got[[0, 1, 2, 4]].sum().backward()
    for i in (0, 1, 2, 4):
        mine = sub[owner == i]
        torch.testing.assert_close(V.grad[i], mine[(mine @ V[i].detach()).argmin()])
    assert torch.equal(V.grad[3], torch.zeros(d, dtype=torch.float64))


def test_refinement_loss_falls_and_norms_kept():
    V0, anchors, owner, neg, same = _synthetic()
    cfg = BuildConfig(refine_steps=300, refine_remine_every=50, refine_hard_negatives=8)
    V, losses = addr.refine_addresses(V0, anchors, owner, neg, same, cfg)
    assert losses[-1] < 0.5 * losses[0]
    torch.testing.assert_close(V.norm(dim=1), V0.norm(dim=1), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_refinement_pulled_towards_the_encoder_addresses(tmp_path):
    """refine_pull: the pulled run ends nearer the stage-2 directions than the free one (each slot
    that refinement moves, by cosine). Each slot then takes its pulled address where its worst
    required anchor still scores above every negative (brute force over all of them) and its free
    one elsewhere; norms are kept; a pull that would overshoot in one step is refused."""
    from aloe_build.checkpoints import PartStore

    V0, anchors, owner, neg, same = _synthetic(n=10)
    base = dict(refine_steps=600, refine_remine_every=50, refine_hard_negatives=8)
    free, free_losses = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(**base))
    parts = PartStore(tmp_path / "4_refine.parts", "key")
    got, losses = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(**base, refine_pull=1.0), parts=parts)
    pulled = parts.get("pulled")["V"]
    cos = torch.nn.functional.cosine_similarity
    moved = cos(free, V0, dim=1) < 1 - 1e-4
    assert moved.sum() >= 5
    assert (cos(pulled, V0, dim=1)[moved] > cos(free, V0, dim=1)[moved]).all()
    keep = torch.zeros(10, dtype=torch.bool)
    for i in range(10):
        negatives = torch.cat([neg.shared[neg.shared_owner != i], neg.specific[neg.specific_owner == i]])
        keep[i] = (anchors[owner == i] @ pulled[i]).min() > (negatives @ pulled[i]).max()
    assert keep.any() and (~keep).any()
    torch.testing.assert_close(got, torch.where(keep[:, None], pulled, free), rtol=0, atol=0)
    assert losses == free_losses
    torch.testing.assert_close(got.norm(dim=1), V0.norm(dim=1), rtol=1e-4, atol=1e-5)
    with pytest.raises(ValueError, match="refine_pull"):
        addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(**base, refine_pull=100.0))


def _hinges(V, anchors, owner, neg, same, cfg):
    """Every slot's hinge against freshly mined negatives (the refinement's objective, full)."""
    s, _ = neg.top(V, same, cfg.refine_hard_negatives)
    pos = torch.full((V.shape[0],), math.inf).scatter_reduce(0, owner, (V[owner] * anchors).sum(-1), reduce="amin")
    return torch.relu(cfg.refine_margin * V.norm(dim=1) - pos + s[:, 0])


def test_refinement_on_the_violating_slots_only():
    """refine_active_every > 0: the first loss is the full one, the slots still violating reach their
    margins as with every slot in every step, and a slot that meets its margin from the start is
    never moved."""
    V0, anchors, owner, neg, same = _synthetic(n=10)
    full_cfg = BuildConfig(refine_steps=400, refine_remine_every=50, refine_hard_negatives=8, refine_active_every=0)
    V_full, loss_full = addr.refine_addresses(V0, anchors, owner, neg, same, full_cfg)
    base = _hinges(V0, anchors, owner, neg, same, full_cfg)
    centre = _unit(anchors[owner == 3].mean(0)) * V0[3].norm()
    V0[3] = centre  # slot 3 starts at the mean of its anchors: margin met
    assert _hinges(V0, anchors, owner, neg, same, full_cfg)[3] == 0 and (base > 0).sum() >= 5
    cfg = BuildConfig(refine_steps=400, refine_remine_every=50, refine_hard_negatives=8, refine_active_every=5)
    V_act, loss_act = addr.refine_addresses(V0, anchors, owner, neg, same, cfg)
    V_full, loss_full = addr.refine_addresses(V0, anchors, owner, neg, same, full_cfg)
    assert loss_act[0] == pytest.approx(loss_full[0], rel=1e-6)
    torch.testing.assert_close(V_act[3], V0[3], rtol=0, atol=1e-6)
    assert _hinges(V_act, anchors, owner, neg, same, cfg).max() <= _hinges(V_full, anchors, owner, neg, same, cfg).max() + 1e-3
    torch.testing.assert_close(V_act.norm(dim=1), V0.norm(dim=1), rtol=1e-4, atol=1e-5)


def test_refinement_stops_where_the_loss_at_remining_is_flat():
    """refine_flat_stop: with a slot no address can separate (one of its own negatives is one of
    its anchors) the loss never reaches 0; the refinement then stops at the first re-mining whose
    loss is within the fraction below the previous re-mining's, and without it runs every step."""
    V0, anchors, owner, neg, same = _synthetic()
    neg.specific[0] = anchors[owner == 0][0]  # slot 0 is inseparable
    base = dict(refine_steps=600, refine_remine_every=50, refine_hard_negatives=8)
    _, every_step = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(**base))
    assert len(every_step) == 600 and min(every_step) > 0
    _, stopped = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(**base, refine_flat_stop=0.05))
    last = len(stopped) - 1
    assert last % 50 == 0 and 50 <= last < 600
    assert stopped == pytest.approx(every_step[: len(stopped)], rel=1e-6)  # the same run up to the stop
    at_remine = stopped[::50]
    assert 0.95 * at_remine[-2] <= at_remine[-1] <= at_remine[-2]
    assert all(not (0.95 * a <= b <= a) for a, b in zip(at_remine[:-2], at_remine[1:-1]))
    with pytest.raises(ValueError, match="refine_flat_stop"):
        addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(**base, refine_flat_stop=1.0))


@pytest.mark.parametrize("pull", [0.0, 1.0])
def test_refinement_resumes_where_it_was_interrupted(tmp_path, monkeypatch, pull):
    """With a part store the refinement saves its state at each re-mining: stopped in the middle
    (mid-way between two re-minings, candidate mining on; with refine_pull, in the free run), a
    second call goes on from the last one and ends with the addresses and loss curve of an
    uninterrupted run."""
    from aloe_build.checkpoints import PartStore

    V0, anchors, owner, neg, same = _synthetic(n=8, negs=300)
    cfg = BuildConfig(
        refine_steps=260,
        refine_remine_every=40,
        refine_candidates=20,
        refine_hard_negatives=6,
        refine_active_every=5,
        refine_pull=pull,
    )
    want_V, want_losses = addr.refine_addresses(V0, anchors, owner, neg, same, cfg)
    assert len(want_losses) == 260
    # with the pull, stopped in the free run, after the pulled run's 260 steps
    stop_at = 150 + (260 if pull else 0)

    calls = {"n": 0}
    real_loss = addr._HingeTerms.loss

    def interrupted(self, V, soft_weight):
        calls["n"] += 1
        if calls["n"] == stop_at:
            raise KeyboardInterrupt
        return real_loss(self, V, soft_weight)

    monkeypatch.setattr(addr._HingeTerms, "loss", interrupted)
    parts = PartStore(tmp_path / "4_refine.parts", "key")
    with pytest.raises(KeyboardInterrupt):
        addr.refine_addresses(V0, anchors, owner, neg, same, cfg, parts=parts)
    assert int(parts.get("progress")["step"]) == 120
    monkeypatch.setattr(addr._HingeTerms, "loss", real_loss)
    V, losses = addr.refine_addresses(V0, anchors, owner, neg, same, cfg, parts=PartStore(tmp_path / "4_refine.parts", "key"))
    torch.testing.assert_close(V, want_V, rtol=0, atol=0)
    assert losses == want_losses


def test_calibration_separable_slot_properties():
    V0, anchors, owner, neg, same = _synthetic()
    V, _ = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(refine_steps=400, refine_hard_negatives=8))
    cal = calibration.calibrate(V, anchors, owner, neg, same, 1e-3, BuildConfig())
    assert cal.separable.all()
    op = AloeOperator(addresses=V, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(6, 4))
    g_anchor = gates_of(anchors, op)[torch.arange(len(owner)), owner]
    worst_pos = torch.full((6,), math.inf).scatter_reduce(0, owner, g_anchor, reduce="amin")
    torch.testing.assert_close(worst_pos, torch.full((6,), 0.9), rtol=0, atol=1e-4)
    # the worst negative of every slot (shared pool, other slots' anchors, own specific) gives exactly 0
    for i in range(6):
        negatives = torch.cat([neg.shared[neg.shared_owner != i], neg.specific[neg.specific_owner == i]])
        assert gates_of(negatives, op)[:, i].max() == 0.0


def test_calibration_open_at_opens_wider_and_keeps_negatives_closed():
    """calibration_open_at=0.5: the gate is open_gate halfway between the worst negative and the worst
    anchor, the worst anchor opens wider than 0.9, and the worst negative still gives exactly 0."""
    V0, anchors, owner, neg, same = _synthetic()
    V, _ = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(refine_steps=400, refine_hard_negatives=8))
    cal = calibration.calibrate(V, anchors, owner, neg, same, 1e-3, BuildConfig(calibration_open_at=0.5))
    assert cal.separable.all()
    half = (cal.worst_negative + cal.worst_positive) / 2
    gate = torch.sigmoid(cal.temperatures * (half - cal.thresholds))
    torch.testing.assert_close((gate - 1e-3) / (1 - 1e-3), torch.full((6,), 0.9), rtol=0, atol=1e-4)
    op = AloeOperator(addresses=V, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(6, 4))
    g_anchor = gates_of(anchors, op)[torch.arange(len(owner)), owner]
    assert torch.full((6,), math.inf).scatter_reduce(0, owner, g_anchor, reduce="amin").min() > 0.9
    for i in range(6):
        negatives = torch.cat([neg.shared[neg.shared_owner != i], neg.specific[neg.specific_owner == i]])
        assert gates_of(negatives, op)[:, i].max() == 0.0
    with pytest.raises(ValueError, match="calibration_open_at"):
        calibration.calibrate(V, anchors, owner, neg, same, 1e-3, BuildConfig(calibration_open_at=0.0))


def test_soft_anchors_turn_addresses_but_never_make_a_slot_inseparable():
    """Soft (paraphrase) anchors: one equal to a negative of its slot leaves the slot separable, its
    request anchors at 0.9 and every negative at exactly 0; one reachable well above the worst
    negative is where the gate reaches 0.9 instead, and refinement raises its score."""
    V0, anchors, owner, neg, same = _synthetic()
    g = torch.Generator().manual_seed(1)
    far = _unit(torch.randn(6, anchors.shape[1], generator=g))  # unrelated directions: hard to reach
    unreachable = neg.specific[2:3]  # a negative of slot 2 itself
    soft_states = torch.cat([anchors, far, unreachable])
    soft_owner = torch.cat([owner, torch.arange(6), torch.tensor([2])])
    soft = torch.cat([torch.zeros(len(owner), dtype=torch.bool), torch.ones(7, dtype=torch.bool)])
    cfg = BuildConfig(refine_steps=400, refine_hard_negatives=8)
    V_hard, _ = addr.refine_addresses(V0, anchors, owner, neg, same, cfg)
    V, _ = addr.refine_addresses(V0, soft_states, soft_owner, neg, same, cfg, soft)
    # the soft hinges turn the addresses towards their far paraphrases (a slot whose request
    # anchors never clear their margin is left as the required anchors alone make it)
    gain = (V * far).sum(1) - (V_hard * far).sum(1)
    assert (gain >= -1e-6).all() and int((gain > 0.1).sum()) >= 4
    cal = calibration.calibrate(V, soft_states, soft_owner, neg, same, 1e-3, BuildConfig(), soft)
    assert cal.separable.all()
    op = AloeOperator(addresses=V, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(6, 4))
    for i in range(6):
        negatives = torch.cat([neg.shared[neg.shared_owner != i], neg.specific[neg.specific_owner == i]])
        assert gates_of(negatives, op)[:, i].max() == 0.0
    g_req = gates_of(anchors, op)[torch.arange(len(owner)), owner]
    assert g_req.min() >= 0.9 - 1e-4
    assert gates_of(unreachable, op)[0, 2] == 0.0
    # the 0.9 point is the worst of the request anchors and the soft anchors that clear the floor
    s_req = slot_sets.min_anchor_scores(V, anchors, owner)
    s_far = (V * far).sum(1)
    floor = cal.worst_negative + BuildConfig().experimental.calibration_soft_floor * (s_req - cal.worst_negative)
    torch.testing.assert_close(cal.worst_positive, torch.where(s_far >= floor, torch.minimum(s_req, s_far), s_req))
    # with every anchor required, slot 2 could not be separated
    assert not bool(calibration.calibrate(V, soft_states, soft_owner, neg, same, 1e-3, BuildConfig()).separable[2])


def test_calibration_inseparable_slot_is_finite_and_balanced():
    V0, anchors, owner, neg, same = _synthetic(n=2)
    # make slot 0 inseparable: one of its specific negatives equals an anchor
    neg.specific[0] = anchors[0]
    cal = calibration.calibrate(V0, anchors, owner, neg, same, 1e-3, BuildConfig(calibration_steps=50))
    assert not bool(cal.separable[0])
    assert torch.isfinite(cal.thresholds).all() and (cal.temperatures > 0).all()
    assert cal.temperatures[0] >= BuildConfig().inseparable_temperature / V0[0].norm() - 1e-6
    # locality first: at most the mined hardest negatives may fall outside the dead zone
    op = AloeOperator(addresses=V0, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(2, 3))
    assert int((gates_of(neg.shared[:200], op)[:, 0] > 0).sum()) <= BuildConfig().refine_hard_negatives


def test_inseparable_slot_opens_on_its_anchors_past_a_few_negatives():
    """A slot two of whose negatives outscore every anchor is inseparable, yet opens at open_gate or
    more on every anchor: only those two negatives open with it, every other negative of it stays in
    the dead zone. A slot with k or more such negatives gets the midpoint, locality first."""
    V0, anchors, owner, neg, same = _synthetic(n=3, negs=300, seed=2)
    cfg = BuildConfig(refine_hard_negatives=8, calibration_steps=50)
    V, _ = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(refine_steps=400, refine_hard_negatives=8))
    top = _unit(V[0])  # scores |v_0| at slot 0, above any of its anchors
    pushed = torch.cat([top[None], _unit(top + 0.05 * _unit(anchors[0]))[None]])
    drowned = _unit(V[1])[None].repeat(8, 1)  # eight copies of slot 1's best direction
    neg = slot_sets.NegativeSet(
        shared=torch.cat([neg.shared, pushed, drowned]),
        shared_owner=torch.cat([neg.shared_owner, torch.full((10,), -1)]),
        specific=neg.specific,
        specific_owner=neg.specific_owner,
    )
    neg_owner_1 = torch.cat([torch.zeros(neg.shared.shape[0] - 8, dtype=torch.bool), torch.ones(8, dtype=torch.bool)])
    cal = calibration.calibrate(V, anchors, owner, neg, same, 1e-3, cfg)
    assert cal.separable.tolist() == [False, False, True]
    op = AloeOperator(addresses=V, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(3, 4))
    own = gates_of(anchors, op)[torch.arange(len(owner)), owner]
    assert (own[owner == 0] >= cfg.open_gate - 1e-4).all() and (own[owner == 2] >= cfg.open_gate - 1e-4).all()
    of_0 = neg.shared_owner != 0  # the shared states that are negatives of slot 0 (not its own anchors)
    g0 = torch.cat([gates_of(neg.shared[of_0], op)[:, 0], gates_of(neg.specific[neg.specific_owner == 0], op)[:, 0]])
    shared_open = ((gates_of(neg.shared, op)[:, 0] > 0) & of_0).nonzero().squeeze(1).tolist()
    assert int((g0 > 0).sum()) == 2 and shared_open == [neg.shared.shape[0] - 10, neg.shared.shape[0] - 9]
    # slot 1: eight negatives above every anchor, the midpoint keeps all but them in the dead zone
    g1 = gates_of(neg.shared, op)[:, 1]
    assert torch.isfinite(cal.thresholds[1]) and int((g1[~neg_owner_1 & (neg.shared_owner != 1)] > 0).sum()) == 0


def test_ridge_recovers_targets_without_overlap():
    V0, anchors, owner, neg, same = _synthetic()
    V, _ = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(refine_steps=300, refine_hard_negatives=8))
    cal = calibration.calibrate(V, anchors, owner, neg, same, 1e-3, BuildConfig())
    op = AloeOperator(addresses=V, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(6, 5))
    deltas = torch.randn(6, 5)
    U = ridge_writes(deltas, anchors, owner, neg.shared[:200], op, BuildConfig(ridge_mu=1e-8))
    torch.testing.assert_close(U, deltas, rtol=1e-3, atol=1e-3)
    # negatives given in parts (never concatenated) weigh exactly as the whole: here states near
    # the anchors, where gates are open and the preservation term pulls the writes down
    near = _unit(anchors + 0.05 * torch.randn(anchors.shape, generator=torch.Generator().manual_seed(1)))
    assert gates_of(near, op).max() > 0.1
    whole = ridge_writes(deltas, anchors, owner, torch.cat([near, neg.shared]), op, BuildConfig())
    parts = ridge_writes(deltas, anchors, owner, [near[:7], near[7:], neg.shared], op, BuildConfig())
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)
    assert whole.norm() < U.norm()


def test_encoder_training_separates_paraphrases():
    g = torch.Generator().manual_seed(0)
    N, d = 64, 32
    base = _unit(torch.randn(N, d, generator=g))
    cs = CorpusStates(
        request=_unit(base + 0.1 * torch.randn(N, d, generator=g)),
        paraphrase=_unit(base + 0.3 * torch.randn(N, d, generator=g)),
        locality=_unit(torch.randn(N, d, generator=g)),
        same_subject=_unit(base[:, None] + 1.0 * torch.randn(N, 2, d, generator=g)),
    )
    cfg = BuildConfig(encoder_dim=16, encoder_steps=200, encoder_batch=16, encoder_lr=1e-2)
    enc = train_encoder(cs, [str(i % 8) for i in range(N)], list(range(N)), cfg)
    s = enc.scores(cs.paraphrase, cs.request)
    acc = (s.argmax(1) == torch.arange(N)).double().mean()
    assert acc > 0.9


def test_refinement_scores_match_min_and_max_with_their_gradients():
    """The refinement's weakest-anchor and hardest-negative scores equal a float64 per-slot min and
    max, values and gradients (a slot without anchors scores +inf and gets no gradient)."""
    g = torch.Generator().manual_seed(11)
    n, k, d = 7, 5, 13
    V = torch.randn(n, d, generator=g)
    owner = torch.tensor([0, 0, 1, 2, 2, 2, 4, 5, 5, 6, 0])  # slot 3 has no anchor
    anchors = torch.randn(len(owner), d, generator=g)
    hard = torch.randn(n, k, d, generator=g)
    weights = torch.randn(n, generator=g)
    Vg = V.clone().requires_grad_(True)
    pos = slot_sets.min_anchor_scores(Vg, anchors, owner)
    neg = addr._hardest_negative(Vg, hard)
    assert pos[3] == math.inf
    (torch.where(torch.isfinite(pos), pos, 0.0) * weights + neg * weights).sum().backward()
    pos, neg = pos.detach(), neg.detach()
    V64, want_grad = V.double(), torch.zeros(n, d, dtype=torch.float64)
    for i in range(n):
        mine = anchors[owner == i].double()
        if mine.shape[0]:
            s = mine @ V64[i]
            assert math.isclose(float(pos[i]), float(s.min()), rel_tol=1e-5, abs_tol=1e-5)
            want_grad[i] += weights[i].double() * mine[int(s.argmin())]
        s_neg = hard[i].double() @ V64[i]
        assert math.isclose(float(neg[i]), float(s_neg.max()), rel_tol=1e-5, abs_tol=1e-5)
        want_grad[i] += weights[i].double() * hard[i, int(s_neg.argmax())].double()
    torch.testing.assert_close(Vg.grad.double(), want_grad, rtol=1e-5, atol=1e-5)


def test_recalibrate_shuts_what_a_slot_separates_and_keeps_its_own_fact_open():
    """An append's new states: one between a slot's worst negative and worst positive raises the
    slot's threshold by the closed form (its worst positive still at open_gate, the state in the
    dead zone); one above its worst positive leaves the slot unchanged; an already inseparable slot
    is shut on the new state."""
    from aloe_build.stages.s7_ridge import gates_of

    cfg, eps = BuildConfig(), 1e-3
    V = torch.eye(3, 5) * 2.0
    s_pos = torch.tensor([1.6, 1.6, 1.0])
    s_neg = torch.tensor([0.4, 0.4, 1.2])  # slot 2 was inseparable
    tau, alpha, _ = calibration._closed_form(s_pos, s_neg, V.norm(dim=1), eps, cfg)
    between = torch.tensor([[0.5, 0.0, 0.0, 0.866, 0.0]])  # slot 0 scores 1.0: between 0.4 and 1.6
    above = torch.tensor([[0.0, 0.9, 0.0, 0.0, 0.436]])  # slot 1 scores 1.8: above its worst positive
    near2 = torch.tensor([[0.0, 0.0, 0.45, 0.0, 0.893]])  # slot 2 scores 0.9: under its own 1.0
    new_tau, new_alpha, new_neg, changed = calibration.recalibrate(V, tau, alpha, s_pos, s_neg, [between, above, near2], eps, cfg)
    assert changed.tolist() == [0, 2]
    assert new_neg.tolist() == pytest.approx([1.0, 0.4, 1.2])
    assert (new_tau[1], new_alpha[1]) == (tau[1], alpha[1])
    op = AloeOperator(addresses=V, thresholds=new_tau, temperatures=new_alpha, writes=torch.zeros(3, 2), gate_eps=eps)
    anchor0 = torch.tensor([[0.8, 0.0, 0.0, 0.6, 0.0]])  # slot 0's worst positive, 1.6
    assert gates_of(anchor0, op)[0, 0] == pytest.approx(0.9, abs=1e-3)
    assert gates_of(between, op)[0, 0] == 0.0 and gates_of(near2, op)[0, 2] == 0.0
    assert gates_of(above, op)[0, 1] > 0.9


def test_ridge_gram_through_open_gates_equals_dense_formula(monkeypatch):
    """Stage 7 on gates that are mostly exactly 0 (the open-gate triplets) against the dense float64
    formula of paper Eq. 6 written out here."""
    V0, anchors, owner, neg, same = _synthetic(n=9, d=24, anchors_per=3, negs=300, seed=5)
    cfg = BuildConfig(ridge_lambda=0.7, ridge_mu=1e-3)
    V, _ = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(refine_steps=200, refine_hard_negatives=8))
    cal = calibration.calibrate(V, anchors, owner, neg, same, 1e-3, BuildConfig())
    # wider gates than calibrated, so that some negatives open some gates too
    op = AloeOperator(addresses=V, thresholds=cal.thresholds - 0.3, temperatures=cal.temperatures, writes=torch.zeros(9, 5))
    deltas = torch.randn(9, 5, generator=torch.Generator().manual_seed(1))
    negatives = [neg.shared, neg.specific]
    Gp = gates_of(anchors, op).double()
    Gn = gates_of(torch.cat(negatives), op).double()
    assert 0 < int((Gn != 0).any(1).sum()) < Gn.shape[0]  # some negative rows open a gate, not all
    Y = Gp[torch.arange(len(owner)), owner][:, None] * deltas.double()[owner]
    want = torch.linalg.solve(Gp.T @ Gp + 0.7 * Gn.T @ Gn + 1e-3 * torch.eye(9, dtype=torch.float64), Gp.T @ Y)
    tally = NegativeGateTally()
    got = ridge_writes(deltas, anchors, owner, negatives, op, cfg, tally)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    assert tally.rows == Gn.shape[0]
    assert tally.any_open == int((Gn != 0).any(1).sum())
    assert tally.max_gate == pytest.approx(float(Gn.max()))
    # anchors and negatives gated a few rows at a time (as at 10,000 edits): the same solve
    import aloe_build.open_gates as og
    from aloe_build.stages import s7_ridge

    whole = og.open_gates
    monkeypatch.setattr(s7_ridge, "open_gates", lambda parts, op, chunk=None, taken=None: whole(parts, op, 4, taken))
    torch.testing.assert_close(ridge_writes(deltas, anchors, owner, negatives, op, cfg).double(), want, rtol=1e-5, atol=1e-6)


def test_open_gates_are_the_nonzeros_of_the_dense_gates():
    """Every non-zero of the dense gate formula, and nothing else, with the same value; over several
    tensors, in blocks that split them, with an empty block, and gates open at every slot."""
    from aloe_build.open_gates import open_gates

    g = torch.Generator().manual_seed(11)
    n, d = 13, 37
    V = _unit(torch.randn(n, d, generator=g))
    states = _unit(torch.randn(301, d, generator=g))
    states[:5] = V[:5]  # these open their own slots
    for tau in (torch.rand(n, generator=g) * 0.4, torch.full((n,), -2.0)):  # some open / all open
        op = AloeOperator(addresses=V, thresholds=tau, temperatures=torch.full((n,), 20.0), writes=torch.zeros(n, 3))
        dense = gates_of(states, op)
        assert 0 < int((dense > 0).sum())
        got = torch.zeros_like(dense)
        row0 = 0
        for part in open_gates([states[:100], states[100:100], states[100:]], op, chunk=33):
            got[row0 + part.rows, part.slots] = part.values
            assert bool((part.values > 0).all())
            row0 += part.n_rows
        assert row0 == states.shape[0]
        # the same entries open; values equal up to the float32 GEMM's blocking over 33 rows or all
        assert torch.equal(got > 0, dense > 0)
        torch.testing.assert_close(got, dense, rtol=1e-6, atol=1e-7)


def test_candidate_mining_follows_the_full_mining_however_far_addresses_move():
    """With few candidates and addresses that travel far from where their candidates were mined, the
    re-minings still find each slot's hardest negative of the whole set: with that one alone mined,
    the run matches one that scores every shared state at every re-mining, and slots are mined in
    full again on the way."""
    V0, anchors, owner, neg, same = _synthetic(n=8, negs=400, seed=5)
    base = dict(refine_steps=500, refine_remine_every=20, refine_hard_negatives=1, refine_active_every=0)
    want_stats, got_stats = {}, {}
    want_V, want_losses = addr.refine_addresses(
        V0, anchors, owner, neg, same, BuildConfig(**base, refine_candidates=0), stats=want_stats
    )
    got_V, got_losses = addr.refine_addresses(
        V0, anchors, owner, neg, same, BuildConfig(**base, refine_candidates=12), stats=got_stats
    )
    assert float(torch.nn.functional.cosine_similarity(want_V, V0, dim=1).min()) < 0.9  # they did travel
    torch.testing.assert_close(got_V, want_V, rtol=0, atol=1e-5)
    assert got_losses == pytest.approx(want_losses, rel=1e-5, abs=1e-7)
    # more than the first mining of each slot, fewer than a full mining of every slot at every re-mining
    assert V0.shape[0] < got_stats["slots_mined_in_full"] < want_stats["slots_mined_in_full"]


def test_refinement_runs_until_every_slot_clears_its_margin():
    """The steps stop once every slot clears its margin against its hardest negatives of the whole
    set (a brute force over them here), well before the cap; with a cap too short, it says so."""
    V0, anchors, owner, neg, same = _synthetic(n=8, negs=400, seed=5)
    cfg = BuildConfig(refine_steps=3000, refine_remine_every=50, refine_hard_negatives=4, refine_candidates=12)
    stats = {}
    V, losses = addr.refine_addresses(V0, anchors, owner, neg, same, cfg, stats=stats)
    assert stats["converged"] and len(losses) < 3000 and losses[-1] == 0.0
    assert (_hinges(V0, anchors, owner, neg, same, cfg) > 0).any()
    assert float(_hinges(V, anchors, owner, neg, same, cfg).max()) <= 1e-5  # rounding of another summation order
    short = {}
    addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(**{**cfg.to_dict(), "refine_steps": 3}), stats=short)
    assert not short["converged"]
