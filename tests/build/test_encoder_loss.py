"""The stage-1 loss against a reference written out term by term, one key and one query at a time."""

from __future__ import annotations

import math

import pytest
import torch
from build_helpers import random_corpus_states, unit

from aloe_build.config import BuildConfig
from aloe_build.stages.s1_encoder import CorpusStates, batch_loss, dropped_batch, train_encoder


def _log_softmax_at(logits: list[float], i: int) -> float:
    top = max(logits)
    return logits[i] - top - math.log(sum(math.exp(v - top) for v in logits))


def _reference(cs: CorpusStates, b: list[int], Q, K, c: float, threshold: float, cfg: BuildConfig) -> float:
    """The loss of method.md, stage 1, in float64 loops."""
    m = cfg.encoder_margin
    S = cs.same_subject.shape[1]

    def key(h):
        return unit(K @ h)

    def score(query_state, key_vec):
        return c * float((Q @ query_state) @ key_vec)

    B = len(b)
    keys = [key(cs.request[i]) for i in b]
    ss_keys = [[key(cs.same_subject[i, s]) for s in range(S)] for i in b]
    pos = [score(cs.paraphrase[i], keys[n]) for n, i in enumerate(b)]
    loc = [[score(cs.locality[j], keys[n]) for j in b] for n in range(B)]  # loc[key][locality input]
    ss = [[[score(cs.same_subject[j, s], keys[n]) for s in range(S)] for j in b] for n in range(B)]
    key_ss = [[score(cs.paraphrase[i], ss_keys[n][s]) for s in range(S)] for n, i in enumerate(b)]

    rank_q = rank_k = margin_loc = margin_ss = 0.0
    negatives: list[float] = []
    for n, i in enumerate(b):
        q_logits = [score(cs.paraphrase[i], keys[k]) for k in range(B)] + key_ss[n]
        rank_q -= _log_softmax_at(q_logits, n) / B
        k_logits = [score(cs.paraphrase[j], keys[n]) for j in b]
        if cfg.experimental.encoder_batch_negatives:
            k_logits += loc[n] + [v for row in ss[n] for v in row]
        else:
            k_logits += [loc[n][n]] + ss[n][n]
        rank_k -= _log_softmax_at(k_logits, n) / B
        margin_loc += max(0.0, m + loc[n][n] - pos[n]) ** 2 / B
        own_ss = ss[n][n] + key_ss[n]
        margin_ss += sum(max(0.0, m + v - pos[n]) ** 2 for v in own_ss) / (B * len(own_ss))
        negatives += [score(cs.paraphrase[i], keys[k]) for k in range(B) if k != n]
        negatives += [loc[k][n] for k in range(B)]  # this item's locality input on every key
        negatives += own_ss
    ortho = sum((float(keys[x] @ keys[y]) - (x == y)) ** 2 for x in range(B) for y in range(B)) / (B * (B - 1))
    loss = rank_q + rank_k + margin_loc + margin_ss + cfg.encoder_ortho * ortho
    if cfg.experimental.encoder_threshold_weight:

        def softplus(v):
            return math.log1p(math.exp(v))

        loss += cfg.experimental.encoder_threshold_weight * (
            sum(softplus(threshold - p) for p in pos) / B + sum(softplus(v - threshold) for v in negatives) / len(negatives)
        )
    return loss


@pytest.mark.parametrize("batch_negatives", [False, True])
@pytest.mark.parametrize("threshold_weight", [0.0, 0.7])
def test_batch_loss_matches_the_term_by_term_reference(batch_negatives, threshold_weight):
    g = torch.Generator().manual_seed(11)
    N, S, d, p = 9, 3, 13, 5
    cs = random_corpus_states(g, N, S, d, torch.float64)
    Q = torch.randn(p, d, generator=g, dtype=torch.float64)
    K = torch.randn(p, d, generator=g, dtype=torch.float64)
    log_c, threshold = torch.tensor(0.8, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)
    cfg = BuildConfig(encoder_batch_negatives=batch_negatives, encoder_threshold_weight=threshold_weight)
    b = [0, 2, 3, 5, 8]
    got = float(batch_loss(cs, torch.tensor(b), Q, K, log_c, threshold, cfg))
    want = _reference(cs, b, Q, K, math.exp(0.8), 0.3, cfg)
    assert got == pytest.approx(want, rel=1e-10)


def test_dropped_batch_zeroes_about_its_rate_and_renormalizes_the_batch_items_only():
    g = torch.Generator().manual_seed(3)
    N, S, d = 7, 2, 400
    cs = random_corpus_states(g, N, S, d)
    b = torch.tensor([1, 4, 6])
    out = dropped_batch(cs, b, 0.3, torch.Generator().manual_seed(5))
    for name, x in (
        ("request", out.request),
        ("paraphrase", out.paraphrase),
        ("locality", out.locality),
        ("same_subject", out.same_subject),
    ):
        src = getattr(cs, name)[b]
        assert x.shape == src.shape
        assert torch.allclose(x.norm(dim=-1), torch.ones(x.shape[:-1]), atol=1e-5)
        zeroed = x == 0
        assert 0.25 < float(zeroed.float().mean()) < 0.35  # 0.3 of about 2,000 coordinates
        # what is kept is the source's coordinates, rescaled by one factor per state
        kept = src.masked_fill(zeroed, 0)
        assert torch.allclose(x, kept / kept.norm(dim=-1, keepdim=True), atol=1e-6)


@pytest.mark.parametrize("rate", [-0.1, 1.0])
def test_encoder_dropout_outside_zero_to_one_is_refused(rate):
    with pytest.raises(ValueError, match="encoder_dropout"):
        BuildConfig(encoder_dropout=rate)


def test_encoder_dropout_zero_trains_as_before_and_nonzero_differs():
    g = torch.Generator().manual_seed(2)
    N, S, d = 24, 2, 16
    cs = random_corpus_states(g, N, S, d)
    groups = [f"r{i % 3}" for i in range(N)]
    base = dict(encoder_dim=4, encoder_steps=5, encoder_batch=8)
    a = train_encoder(cs, groups, list(range(N)), BuildConfig(**base))
    b = train_encoder(cs, groups, list(range(N)), BuildConfig(**base, encoder_dropout=0.0))
    c = train_encoder(cs, groups, list(range(N)), BuildConfig(**base, encoder_dropout=0.3))
    assert torch.equal(a.Q, b.Q) and torch.equal(a.K, b.K)
    assert not torch.allclose(a.Q, c.Q)
