"""The address-mechanism protocols and metrics against brute-force references."""

from __future__ import annotations

import itertools

import pytest
import torch

from aloe_build.config import BuildConfig
from aloe_build.corpus import Corpus
from aloe_build.data import EditRequest
from aloe_build.mechanism_protocol import (
    SAME_SUBJECT_KEYS,
    auc,
    budget_threshold,
    evaluate_addresses,
    mechanism_metrics,
    partition,
    same_subject_key_prompts,
    score_items,
    transferred_threshold,
)
from aloe_build.stages.s1_encoder import CorpusStates, train_encoder

_TEMPLATES = [  # three relations, two wordings each (the rephrase links them into one group)
    ("{} was born in", "{} came into the world in"),
    ("{} works as a", "The job of {} is"),
    ("{} speaks", "The language of {} is"),
    ("{} plays the", "The instrument of {} is"),
]
_SUBJECTS = [f"Person{i}" for i in range(30)]


def _corpus() -> Corpus:
    records = []
    for i, s in enumerate(_SUBJECTS):
        for j, (t, r) in enumerate(_TEMPLATES):
            if (i + j) % 4 == 3:  # not every subject under every relation
                continue
            records.append(
                EditRequest(
                    prompt=t.format(s),
                    target_new="x",
                    subject=s,
                    ground_truth="y",
                    rephrases=(r.format(s),),
                    locality=(t.format(_SUBJECTS[(i + 7) % 30]),),
                    id=f"{i}-{j}",
                )
            )
    return Corpus(records, same_subject=2, seed=0)


def test_auc_matches_pairwise_count_with_ties():
    g = torch.Generator().manual_seed(1)
    pos = torch.randint(0, 6, (17,), generator=g).float()
    neg = torch.randint(0, 6, (23,), generator=g).float()
    expected = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos.tolist(), neg.tolist()))
    assert auc(pos, neg) == pytest.approx(expected / (17 * 23), abs=1e-12)


def test_transferred_threshold_maximizes_recall_minus_mean_fpr():
    g = torch.Generator().manual_seed(2)
    pos = torch.randn(31, generator=g) + 1.5
    negs = {"a": torch.randn(13, generator=g), "b": torch.randn(40, generator=g) + 0.5}

    def objective(t: float) -> float:
        tpr = sum(float(p) > t for p in pos) / len(pos)
        fpr = sum(sum(float(x) > t for x in n) / len(n) for n in negs.values()) / len(negs)
        return tpr - fpr

    candidates = torch.cat([pos, *negs.values()]).tolist()
    best = max(objective(t) for t in candidates)
    assert objective(transferred_threshold(pos, negs)) == pytest.approx(best, abs=1e-12)


@pytest.mark.parametrize("budget", [0.0, 0.05, 0.3])
def test_budget_threshold_is_the_lowest_score_within_the_fpr_budget(budget):
    g = torch.Generator().manual_seed(4)
    pos = torch.randn(29, generator=g) + 1.0
    negs = {"a": torch.randn(11, generator=g), "b": torch.randn(37, generator=g) + 0.3}

    def mean_fpr(t: float) -> float:
        return sum(sum(float(x) > t for x in n) / len(n) for n in negs.values()) / len(negs)

    candidates = torch.cat([pos, *negs.values()]).double().tolist()
    expected = min(t for t in candidates if mean_fpr(t) <= budget)
    t = budget_threshold(pos, negs, budget)
    assert t == expected and mean_fpr(t) <= budget


def test_budget_metrics_count_at_their_own_threshold():
    s = score_items(
        torch.eye(3),
        torch.tensor([[2.0, 0, 0], [0, 0.5, 0], [0, 0, 3.0]]),
        torch.tensor([[0.2, 0, 0], [0, 0.8, 0], [0, 0, 0.1]]),
        torch.zeros(3, 1, 3),
    )
    m = mechanism_metrics(s, 1.0, None, threshold_at_budget=0.15)
    # at 0.15: paraphrases 2.0, 0.5, 3.0 all fire; locality 0.2 and 0.8 of 0.2, 0.8, 0.1 fire,
    # same-subject (0) and other items' scores (all 0) do not
    assert m["recall_at_budget"] == pytest.approx(1.0)
    assert m["negative_fpr_at_budget"] == pytest.approx((2 / 3) / 3)
    assert m["recall"] == pytest.approx(2 / 3) and m["negative_fpr"] == 0.0 and m["threshold_at_budget"] == 0.15


def test_score_items_matches_loops():
    g = torch.Generator().manual_seed(3)
    N, S, d = 5, 3, 7
    A, P, L = (torch.randn(N, d, generator=g) for _ in range(3))
    R = torch.randn(N, S, d, generator=g)
    s = score_items(A, P, L, R)
    for i in range(N):
        assert s.positive[i] == pytest.approx(float(P[i] @ A[i]), abs=1e-5)
        assert s.locality[i] == pytest.approx(float(L[i] @ A[i]), abs=1e-5)
        for k in range(S):
            assert s.same_subject[i, k] == pytest.approx(float(R[i, k] @ A[i]), abs=1e-5)
        expected = sorted([float(P[j] @ A[i]) for j in range(N) if j != i] + [float(L[j] @ A[i]) for j in range(N) if j != i])
        assert sorted(s.others[i].tolist()) == pytest.approx(expected, abs=1e-5)


def test_metrics_count_what_the_threshold_lets_through():
    s = score_items(torch.eye(3), torch.tensor([[2.0, 0, 0], [0, 0.5, 0], [0, 0, 3.0]]), torch.zeros(3, 3), torch.zeros(3, 1, 3))
    m = mechanism_metrics(s, 1.0, torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 4.0]]))
    assert m["recall"] == pytest.approx(2 / 3)
    assert m["negative_fpr"] == 0.0 and m["fpr_locality"] == 0.0 and m["fpr_same_subject"] == 0.0
    assert m["same_subject_top1"] == pytest.approx(2 / 3)
    assert m["fpr_others"] == 0.0 and m["auc_locality"] == pytest.approx(1.0)


def test_subject_protocol_keeps_subjects_and_surfaces_apart_and_shares_relations():
    corpus = _corpus()
    part = partition(corpus, "subject", 20, seed=0)
    subj = [{corpus.items[i].subject for i in idx} for idx in (part.train, part.calibration, part.dev)]
    assert not (subj[0] & subj[1] or subj[0] & subj[2] or subj[1] & subj[2])
    dev_surfaces = {t for i in part.dev for t in (corpus.items[i].request, corpus.items[i].paraphrase, corpus.items[i].locality)}
    assert not any(corpus.items[i].request in dev_surfaces or corpus.items[i].paraphrase in dev_surfaces for i in part.train)
    assert {corpus.items[i].group for i in part.dev} <= {corpus.items[i].group for i in part.train}
    assert len(part.dev) >= 20 and len(part.calibration) >= 20 and part.train


def test_relation_protocol_holds_out_whole_relations():
    corpus = _corpus()
    part = partition(corpus, "relation", 1000, seed=0)
    groups = [{corpus.items[i].group for i in idx} for idx in (part.train, part.calibration, part.dev)]
    assert groups[0] and groups[1] and groups[2]
    assert not (groups[0] & groups[1] or groups[0] & groups[2] or groups[1] & groups[2])
    with pytest.raises(ValueError, match="unknown mechanism protocol"):
        partition(corpus, "nope", 10, 0)


def test_same_subject_keys_are_other_relations_of_the_subject():
    corpus = _corpus()
    part = partition(corpus, "subject", 10, seed=0)
    prompts = same_subject_key_prompts(corpus, part.dev, seed=1)
    for i, ps in zip(part.dev, prompts):
        it = corpus.items[i]
        assert len(ps) == SAME_SUBJECT_KEYS
        for p in ps:
            assert it.subject in p and corpus.group_of_template[p.replace(it.subject, "{}")] != it.group


def test_same_subject_keys_in_training_raise_same_subject_top1():
    """States where a subject's other-relation requests lie close to its paraphrase: the objective with
    those prompts as competing keys picks the right relation more often than the one without."""
    g = torch.Generator().manual_seed(0)
    N, S, d = 256, 4, 48
    unit = torch.nn.functional.normalize
    subject = unit(torch.randn(N, d, generator=g))
    relations = unit(torch.randn(8, d, generator=g))
    rel = torch.arange(N) % 8
    other = (rel[:, None] + torch.arange(1, S + 1)) % 8

    def state(r, noise):
        return unit(
            subject[:, None] * 2.0
            + relations[r].reshape(N, -1, d) * 0.5
            + noise * torch.randn(N, r.reshape(N, -1).shape[1], d, generator=g)
        )

    cs = CorpusStates(
        request=state(rel, 0.05)[:, 0],
        paraphrase=state(rel, 0.05)[:, 0],
        locality=unit(torch.randn(N, d, generator=g)),
        same_subject=state(other, 0.05),
    )
    train, dev = list(range(0, N, 2)), list(range(1, N, 2))
    keys = state(other, 0.05)  # fresh prompts of the same subjects' other relations as competing keys
    results = {}
    for flag in (False, True):
        cfg = BuildConfig(encoder_dim=24, encoder_steps=300, encoder_batch=32, encoder_lr=1e-2, encoder_same_subject_keys=flag)
        enc = train_encoder(cs, [str(int(r)) for r in rel], train, cfg)
        b = torch.tensor(dev)
        keys16 = torch.cat([cs.request[b][:, None], keys[b]], 1)
        a16 = enc.addresses(keys16.reshape(-1, d)).reshape(len(dev), S + 1, d)
        results[flag] = float((torch.einsum("nkd,nd->nk", a16, cs.paraphrase[b]).argmax(1) == 0).double().mean())
    assert results[True] > results[False] + 0.03, results


def test_evaluate_addresses_transfers_the_calibration_threshold():
    """Identity addresses on states where positives equal requests: perfect recall and AUC 1."""
    g = torch.Generator().manual_seed(4)
    corpus = _corpus()
    N, d = len(corpus.items), 64
    req = torch.nn.functional.normalize(torch.randn(N, d, generator=g), dim=-1)
    cs = CorpusStates(
        req,
        req.clone(),
        torch.nn.functional.normalize(torch.randn(N, d, generator=g), dim=-1),
        torch.nn.functional.normalize(torch.randn(N, 2, d, generator=g), dim=-1),
    )
    part = partition(corpus, "subject", 20, seed=0)
    m = evaluate_addresses(lambda h: h, cs, part, None)
    assert m["recall"] == 1.0 and m["scope_auc"] == 1.0 and m["items"] == len(part.dev)
    assert 0.0 <= m["negative_fpr"] < 0.05 and "same_subject_top1" not in m
