"""Stage 5: calibration turns the refined scores into gates.

A separable slot opens at 0.9 on its worst anchor and keeps its worst negative
inside the dead zone. An inseparable slot with anchors that clear all but a
few of its hardest negatives is calibrated the same way between the lowest of
those anchors and the highest negative below it (the negatives above it open
too); any other gets a finite-temperature midpoint fitted to a balanced
worst-case loss. An append recalibrates the old slots that would open on the
new states (:func:`recalibrate`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.nn.functional as F

from .. import distributed
from ..config import BuildConfig
from ..slot_sets import NegativeSet, min_anchor_scores
from ..slots import SamePrompt


@dataclass
class Calibration:
    thresholds: torch.Tensor
    temperatures: torch.Tensor
    separable: torch.Tensor  # bool per slot
    worst_positive: torch.Tensor
    worst_negative: torch.Tensor


#: slots scored together against the negatives; a distributed build deals out whole blocks, so that each
#: block's product, and with it every score, is the same bits in any number of processes
CALIBRATION_BLOCK = 512


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def calibrate(
    V: torch.Tensor,
    anchors: torch.Tensor,
    anchor_owner: torch.Tensor,
    negatives: NegativeSet,
    same_prompt: SamePrompt,
    gate_eps: float,
    cfg: BuildConfig,
    soft: torch.Tensor | None = None,
    open_at: torch.Tensor | None = None,
) -> Calibration:
    """Stage 5: thresholds and temperatures from the worst anchor and the worst negative of each slot.

    Anchors marked ``soft`` count only where they clear the slot's worst negative by at least
    ``calibration_soft_floor`` of its required anchors' gap: a paraphrase that the address cannot
    separate from a negative is left out rather than opening the gate on that negative. ``open_at``
    gives each slot its own ``calibration_open_at`` (chat slots, :mod:`aloe_build.chat_slots`)."""
    if not 0.0 < cfg.calibration_open_at <= 1.0:
        raise ValueError(f"calibration_open_at must be in (0, 1], got {cfg.calibration_open_at}")
    soft = torch.zeros(anchors.shape[0], dtype=torch.bool, device=anchors.device) if soft is None else soft
    anchors, anchor_owner, soft_a, soft_own = anchors[~soft], anchor_owner[~soft], anchors[soft], anchor_owner[soft]
    s_pos = min_anchor_scores(V, anchors, anchor_owner)
    hard_s, hard_h = hardest_negatives(V, negatives, same_prompt, cfg.refine_hard_negatives)
    s_neg = hard_s[:, 0]
    if soft_own.numel():
        s_soft = (V[soft_own] * soft_a).sum(-1)
        floor = s_neg + cfg.experimental.calibration_soft_floor * (s_pos - s_neg)
        counted = (s_soft >= floor[soft_own]) & (s_pos > s_neg)[soft_own]
        s_pos = torch.minimum(s_pos, min_anchor_scores(V, soft_a[counted], soft_own[counted]))
    norms = V.norm(dim=1).clamp_min(1e-12)
    tau, alpha, separable = _closed_form(s_pos, s_neg, norms, gate_eps, cfg, open_at)
    anchor_s = torch.einsum("ad,ad->a", anchors, V[anchor_owner])
    opened, s_open, below = _open_past_negatives(anchor_s, anchor_owner, hard_s, norms, separable)
    if opened.numel():
        t, a, _ = _closed_form(s_open, below, norms[opened], gate_eps, cfg, None if open_at is None else open_at[opened.cpu()])
        tau[opened], alpha[opened] = t, a
    bad = (~separable).nonzero().squeeze(1)
    bad = bad[~torch.isin(bad, opened)]
    if bad.numel():
        tau_b, alpha_b = _fit_inseparable(V[bad], anchors, anchor_owner, bad, hard_h(bad), tau[bad], alpha[bad], cfg)
        # Locality first: whatever the fit, the dead zone must still cover every negative but
        # the mined hardest ones, or a slot whose anchors sit among generic states would open
        # on everything.
        tau_b = torch.maximum(tau_b, hard_s[bad, -1] - _logit(gate_eps) / alpha_b)
        tau[bad], alpha[bad] = tau_b, alpha_b
    return Calibration(tau, alpha, separable, s_pos, s_neg)


def hardest_negatives(
    V: torch.Tensor, negatives: NegativeSet, same_prompt: SamePrompt, k: int
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """Each slot's k hardest negatives: their scores (n, k), best first, and a function that gives
    the states (len(rows), k, d) of the slots ``rows``. Scoring every slot against every shared state
    is the stage's cost, so in a distributed build each rank scores its share of the blocks of
    :data:`CALIBRATION_BLOCK` slots and the scores, zero at the other ranks' slots, are summed
    (exactly: x + 0 = x); the states are summed the same way for the rows asked, which every rank
    asks alike."""
    if not distributed.active():
        scores, states = negatives.top(V, same_prompt, k, chunk=CALIBRATION_BLOCK)
        return scores, lambda rows: states[rows]
    n, block = V.shape[0], CALIBRATION_BLOCK
    starts = [lo for lo in range(0, n, block) if distributed.takes(lo // block)]
    mine = torch.cat([torch.arange(lo, min(lo + block, n)) for lo in starts] or [torch.zeros(0, dtype=torch.long)])
    mine = mine.to(V.device)
    my_scores, my_states = negatives.top(V[mine], same_prompt[mine], k, chunk=block, slots=mine)
    scores = torch.zeros(n, my_scores.shape[1], dtype=my_scores.dtype, device=V.device)
    scores[mine] = my_scores
    where = torch.full((n,), -1, dtype=torch.long, device=V.device)
    where[mine] = torch.arange(mine.numel(), device=V.device)

    def states_of(rows: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(rows.numel(), *my_states.shape[1:], dtype=my_states.dtype, device=V.device)
        here = where[rows] >= 0
        out[here] = my_states[where[rows][here]]
        return distributed.summed(out)

    return distributed.summed(scores), states_of


def _open_past_negatives(
    anchor_s: torch.Tensor, anchor_owner: torch.Tensor, hard_s: torch.Tensor, norms: torch.Tensor, separable: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inseparable slots that can still open on their anchors at the cost of fewer than k
    negatives: those with an anchor scoring above their k-th hardest negative (``hard_s``, (n, k),
    best first; ``anchor_s``: each anchor's score at its own slot). Returns the slots, each one's
    lowest such anchor score (where its gate is to reach ``open_gate``) and where its dead zone is to
    begin: the highest negative score below that anchor, or a thousandth of |v| below the anchor if
    that is lower.

    A midpoint gate cannot serve such a slot: the dead zone must cover every negative but the k
    hardest (locality first), and a gate soft enough to sit between anchors and negatives then
    puts the slot's own anchors in the dead zone too, so no write reaches its request. Opening at
    the lowest anchor that clears the k-th negative costs only the negatives above that anchor,
    which the dead-zone rule already allows, and the anchors below it (usually none: the worst
    anchor itself is the one that clears)."""
    n, k = hard_s.shape
    clear = anchor_s > hard_s[anchor_owner, -1]
    s_open = torch.full((n,), math.inf, dtype=hard_s.dtype, device=hard_s.device).scatter_reduce(
        0, anchor_owner[clear], anchor_s[clear].to(hard_s.dtype), reduce="amin"
    )
    above = (hard_s >= s_open[:, None]).sum(1).clamp_max(k - 1)  # the hardest negatives at or above it
    below = hard_s.gather(1, above[:, None]).squeeze(1)
    ok = ~separable & torch.isfinite(s_open) & torch.isfinite(below) & (s_open > below)
    rows = ok.nonzero().squeeze(1)
    # the dead zone starts at least a thousandth of |v| below the anchor: a narrower gap would make a
    # gate steep enough for rounding to flip it (the negatives in that sliver open a little)
    return rows, s_open[rows], torch.minimum(below[rows], s_open[rows] - 1e-3 * norms[rows])


def _closed_form(
    s_pos: torch.Tensor,
    s_neg: torch.Tensor,
    norms: torch.Tensor,
    gate_eps: float,
    cfg: BuildConfig,
    open_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thresholds, temperatures and separability from each slot's worst anchor and worst negative
    scores; an inseparable slot gets the midpoint at ``inseparable_temperature``. ``open_at``: each
    slot's ``calibration_open_at`` (default: the configured one for all)."""
    p_open = gate_eps + cfg.open_gate * (1 - gate_eps)
    z_pos = _logit(p_open)
    # the worst negative lands this many logits below the dead-zone edge: its gate is exactly 0
    z_neg = _logit(gate_eps) - cfg.calibration_negative_slack
    gap = s_pos - s_neg
    separable = gap > 1e-6 * norms
    # the gate reaches open_gate this far from the worst negative towards the worst anchor
    # (1 = at the worst anchor, the paper's calibration; less opens states between the two wider)
    reach = (cfg.calibration_open_at if open_at is None else open_at.to(gap)) * gap
    alpha = torch.where(separable, (z_pos - z_neg) / reach.clamp_min(1e-12), cfg.inseparable_temperature / norms)
    tau = torch.where(separable, s_neg + reach - z_pos / alpha, (s_pos + s_neg) / 2)
    return tau, alpha, separable


def recalibrate(
    V: torch.Tensor,
    tau: torch.Tensor,
    alpha: torch.Tensor,
    s_pos: torch.Tensor,
    s_neg: torch.Tensor,
    states: Sequence[torch.Tensor],
    gate_eps: float,
    cfg: BuildConfig,
    chunk: int = 8192,
    open_at: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 5 again for the slots that would open on new negative ``states`` (an append's anchors
    and negatives). Only the new states a slot can separate from its own anchors count, those
    scoring below its worst positive: the highest of them becomes the slot's worst negative and the
    closed form gives new thresholds and temperatures. A new state scoring at or above a slot's worst
    positive (another subject's request in the same template, say, which a one-shot build would
    separate by refining both addresses together) leaves the slot as it was: shutting it would shut
    its own fact, and the new edit's write is fitted with the old edits in place, so it corrects for
    the old write where the two gates overlap. A slot that was already inseparable keeps its
    temperature and moves its threshold just far enough that the new state falls in the dead zone
    (locality first, as stage 5 does for inseparable slots).

    ``open_at``: each slot's ``calibration_open_at``, as for :func:`calibrate`. Returns ``(tau, alpha,
    s_neg, changed)``: the updated (n,) tensors and the indices recalibrated."""
    floor = tau + _logit(gate_eps) / alpha  # scores at or below this are in the dead zone
    best = torch.full_like(s_neg, -math.inf)
    with torch.no_grad():
        for part in states:
            for start in range(0, part.shape[0], chunk):
                s = part[start : start + chunk].to(V) @ V.T
                best = torch.maximum(best, s.masked_fill(s >= s_pos[None, :], -math.inf).amax(0))
    changed = (best > floor).nonzero().squeeze(1)
    tau, alpha, s_neg = tau.clone(), alpha.clone(), s_neg.clone()
    if changed.numel():
        s_neg[changed] = torch.maximum(s_neg[changed], best[changed])
        norms = V[changed].norm(dim=1).clamp_min(1e-12)
        t, a, sep = _closed_form(
            s_pos[changed], s_neg[changed], norms, gate_eps, cfg, None if open_at is None else open_at[changed.cpu()]
        )
        a = torch.where(sep, a, alpha[changed])
        # the margin of calibration_negative_slack logits below the dead-zone edge, as for any negative
        t = torch.where(sep, t, best[changed] - (_logit(gate_eps) - cfg.calibration_negative_slack) / a)
        tau[changed], alpha[changed] = t, a
    return tau, alpha, s_neg, changed


def _fit_inseparable(V, anchors, anchor_owner, rows, hard_h, tau0, alpha0, cfg: BuildConfig):
    """Balanced worst-case loss of an inseparable slot over its anchors and hardest negatives:
    the mean of a logistic loss on the worst half of each side, alpha kept >= its initial value."""
    remap = torch.full((int(anchor_owner.max()) + 1,), -1, dtype=torch.long, device=anchor_owner.device)
    remap[rows] = torch.arange(len(rows), device=rows.device)
    keep = remap[anchor_owner] >= 0
    a_h, a_own = anchors[keep], remap[anchor_owner[keep]]
    s_pos = (V[a_own] * a_h).sum(-1)
    s_neg = torch.einsum("nkd,nd->nk", hard_h, V)
    tau = tau0.clone().requires_grad_(True)
    log_extra = torch.zeros_like(alpha0, requires_grad=True)
    opt = torch.optim.Adam([tau, log_extra], lr=0.05)
    for _ in range(cfg.calibration_steps):
        alpha = alpha0 * log_extra.exp()
        lp = F.softplus(-alpha[a_own] * (s_pos - tau[a_own]))
        worst_pos = torch.zeros_like(tau).scatter_reduce(0, a_own, lp, reduce="amax", include_self=False)
        ln = F.softplus(alpha[:, None] * (s_neg - tau[:, None]))
        worst_neg = ln.topk(max(1, ln.shape[1] // 2), dim=1).values.mean(1)
        loss = (worst_pos + worst_neg).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            log_extra.clamp_(min=0.0)
    return tau.detach(), (alpha0 * log_extra.exp()).detach()
