"""Stages 2-5: initialise, refine and calibrate the addresses.

(2) v_i = c Q^T norm(K h(t_i)) from the request state.
(4) Paper Eq. 5: a squared hinge pushes each address towards its worst
    anchor and away from its worst negative; address norms are preserved.
(5) Calibration turns scores into gates: a separable slot opens at 0.9 on its
    worst anchor and keeps its worst negative inside the dead zone; an
    inseparable slot gets a finite-temperature midpoint fitted to a balanced
    worst-case loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .config import BuildConfig


@dataclass
class NegativeSet:
    """Negative states: a pool shared by every slot plus states that are negatives of one slot only."""

    shared: torch.Tensor  # (M, d)
    shared_owner: torch.Tensor  # (M,) slot whose anchor or request continuation each is (-1: a negative of every slot)
    specific: torch.Tensor  # (S, d)
    specific_owner: torch.Tensor  # (S,) the one slot each is a negative of

    def to(self, device: torch.device) -> "NegativeSet":
        """The set on ``device`` when its states take at most a quarter of the free memory there; else
        left where it is (on CPU), and :meth:`top` streams it to the addresses' device in chunks."""
        if device.type == "cuda":
            nbytes = sum(t.numel() * t.element_size() for t in (self.shared, self.specific))
            if nbytes > torch.cuda.mem_get_info(device)[0] // 4:
                return self
        return NegativeSet(*(t.to(device) for t in (self.shared, self.shared_owner, self.specific,
                                                    self.specific_owner)))

    def worst(self, V: torch.Tensor, same_prompt: torch.Tensor, chunk: int = 512) -> torch.Tensor:
        """max_{h in N_i} v_i^T h for every slot, over the whole set."""
        return self.top(V, same_prompt, 1, chunk)[0][:, 0]

    def top(self, V: torch.Tensor, same_prompt: torch.Tensor, k: int, chunk: int = 512,
            stream_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The k hardest negatives of every slot: (scores (n, k), states (n, k, d)).

        The set may live on another device than ``V`` (a GPU build keeps large sets on CPU): it is
        then read in pieces of ``stream_rows`` states (65,536 by default)."""
        n, d = V.shape
        best_s = torch.full((n, k), -math.inf, device=V.device)
        best_h = torch.zeros(n, k, d, device=V.device)
        with torch.no_grad():
            for start in range(0, n, chunk):
                rows = torch.arange(start, min(n, start + chunk), device=V.device)
                # states held elsewhere (a GPU build whose negatives stay on CPU) come over in pieces
                step = stream_rows or (self.shared.shape[0] if self.shared.device == V.device else 65536)
                for lo in range(0, max(1, self.shared.shape[0]), step):
                    part = self.shared[lo: lo + step].to(V.device)
                    owner = self.shared_owner[lo: lo + step].to(V.device)
                    s = V[rows] @ part.T  # (r, M)
                    # anchors of the slot itself, and of slots with the same prompt (conflicting targets), are
                    # not negatives
                    blocked = (owner[None, :] >= 0) & same_prompt[rows][:, owner.clamp_min(0)]
                    s = s.masked_fill(blocked, -math.inf)
                    kk = min(k, s.shape[1])
                    if not kk:
                        continue
                    vals, idx = s.topk(kk, dim=1)
                    if lo == 0:
                        best_s[rows, :kk] = vals
                        best_h[rows, :kk] = part[idx]
                    else:  # merge this piece's best with the best so far
                        vals, pick = torch.cat([best_s[rows], vals], 1).topk(k, dim=1)
                        cand = torch.cat([best_h[rows], part[idx]], 1)
                        best_s[rows], best_h[rows] = vals, cand[torch.arange(len(rows), device=V.device)[:, None], pick]
            if self.specific.shape[0]:
                # in chunks: V[owner] for every specific state would be another copy of them all
                s_spec = torch.cat([
                    torch.einsum("sd,sd->s", V[self.specific_owner[j: j + 16384].to(V.device)],
                                 self.specific[j: j + 16384].to(V.device))
                    for j in range(0, self.specific.shape[0], 16384)])
                # each slot's own states by one sort, not a scan of all of them per slot
                order = torch.argsort(self.specific_owner, stable=True)
                ends = torch.bincount(self.specific_owner, minlength=n).cumsum(0).tolist()
                for i in range(n):
                    sel = order[(ends[i - 1] if i else 0): ends[i]]
                    if sel.numel() == 0:
                        continue
                    cand_s = torch.cat([best_s[i], s_spec[sel.to(V.device)]])
                    cand_h = torch.cat([best_h[i], self.specific[sel].to(V.device)])
                    vals, idx = cand_s.topk(k)
                    best_s[i], best_h[i] = vals, cand_h[idx]
        return best_s, best_h


# rows of a per-anchor temporary: 2,048 x d floats stay below the size at which glibc maps each
# allocation afresh (32 MiB) for d up to 4,096
_ROWS = 2048


def min_anchor_scores(V: torch.Tensor, anchors: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """min_{h in P_i} v_i^T h for every slot (+inf for a slot without anchors). The minimising
    anchor is found without autograd and the gradient flows through one dot product per slot, the
    gradient of ``min``, without differentiating a gather of V for every anchor."""
    n, m = V.shape[0], owner.shape[0]
    if m == 0:
        return torch.full((n,), math.inf, dtype=V.dtype, device=V.device)
    with torch.no_grad():
        # in pieces: V[owner] for every anchor at once is a fresh block of hundreds of megabytes at
        # every step of a large build, which the allocator maps and the kernel zeroes each time
        s = torch.cat([torch.einsum("ad,ad->a", V[owner[j: j + _ROWS]], anchors[j: j + _ROWS])
                       for j in range(0, m, _ROWS)])
        low = torch.full((n,), math.inf, dtype=s.dtype, device=s.device).scatter_reduce(0, owner, s, reduce="amin")
        at_min = s == low[owner]
        first = torch.full((n,), m, dtype=torch.long, device=owner.device).scatter_reduce(
            0, owner[at_min], torch.arange(m, device=owner.device)[at_min], reduce="amin")
        has = first < m
    return torch.where(has, (anchors[first.clamp_max(m - 1)] * V).sum(-1), math.inf)


def _hardest_negative(V: torch.Tensor, hard_h: torch.Tensor) -> torch.Tensor:
    """max_k v_i^T h_ik over each slot's mined negatives (n, k, d), with the gradient through the
    maximiser only, as ``max`` gives it: found without autograd, so the backward pass reads one
    state per slot, not all k."""
    with torch.no_grad():
        j = torch.einsum("nkd,nd->nk", hard_h, V).argmax(1)
    return (hard_h[torch.arange(V.shape[0], device=V.device), j] * V).sum(-1)


def refine_addresses(
    V0: torch.Tensor,
    anchors: torch.Tensor,
    anchor_owner: torch.Tensor,
    negatives: NegativeSet,
    same_prompt: torch.Tensor,
    cfg: BuildConfig,
    soft: torch.Tensor | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Paper Eq. 5 with hard-negative re-mining; returns refined addresses and the loss curve.

    ``soft`` marks anchors that are wished for rather than required (paraphrases built from
    construction data): they do not enter the worst-anchor hinge; each adds its own squared hinge,
    weighted by ``refine_soft_weight`` and averaged, that turns the address towards it during the
    first two thirds of the steps; the last third restores the required anchors' margin."""
    soft = torch.zeros(anchors.shape[0], dtype=torch.bool, device=anchors.device) if soft is None else soft
    n = V0.shape[0]
    norms = V0.norm(dim=1, keepdim=True).clamp_min(1e-12)
    soft_phase = bool(soft.any()) and cfg.refine_soft_weight > 0
    soft_steps = (2 * cfg.refine_steps) // 3
    V = V0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([V], lr=cfg.refine_lr, weight_decay=0.0)
    margin = cfg.refine_margin * norms.squeeze(1)
    if not 0.0 <= cfg.refine_flat_stop < 1.0:
        raise ValueError(f"refine_flat_stop must be in [0, 1), got {cfg.refine_flat_stop}")
    losses: list[float] = []
    hard_h, terms = None, None
    at_remine: float | None = None  # the loss at the last re-mining, where every slot is scored
    bar = tqdm(range(cfg.refine_steps), desc="stage 4: address refinement", leave=False)
    for step in bar:
        # the last third runs on the required anchors alone, from freshly mined negatives: it
        # restores the request's margin wherever the pull towards the paraphrases cost it
        soft_now = soft_phase and step < soft_steps
        boundary = soft_phase and step == soft_steps
        remine = hard_h is None or step % cfg.refine_remine_every == 0 or boundary
        if remine:
            _, hard_h = negatives.top(V.detach(), same_prompt, cfg.refine_hard_negatives)
            terms = None
        if terms is None or boundary or (cfg.refine_active_every > 0 and step % cfg.refine_active_every == 0):
            everything = torch.ones(n, dtype=torch.bool, device=V.device)
            terms = _HingeTerms(anchors, anchor_owner, soft, hard_h, margin, everything, soft_now)
            if cfg.refine_active_every > 0:
                with torch.no_grad():
                    active = terms.violating(V)
                terms = _HingeTerms(anchors, anchor_owner, soft, hard_h, margin, active, soft_now)
                _stop_coasting(opt, V, active)
        loss = terms.loss(V, cfg.refine_soft_weight)
        if not torch.isfinite(loss):
            raise FloatingPointError("stage 4 (address refinement): loss became NaN/Inf")
        losses.append(float(loss.detach()))
        if remine and cfg.refine_flat_stop > 0 and not soft_now:
            # between re-minings the loss fell by less than refine_flat_stop of itself: the slots
            # still violating are those no step moves (a rise means newly mined negatives: go on)
            if at_remine is not None and (1 - cfg.refine_flat_stop) * at_remine <= losses[-1] <= at_remine:
                break
            at_remine = losses[-1]
        if losses[-1] == 0.0 and step % cfg.refine_remine_every != 0:
            # every slot clears its margin against the mined negatives: re-mine to confirm
            _, hard_h = negatives.top(V.detach(), same_prompt, cfg.refine_hard_negatives)
            check = _HingeTerms(anchors, anchor_owner, soft, hard_h, margin, torch.ones(n, dtype=torch.bool,
                                device=V.device), False)
            if float(check.loss(V.detach(), 0.0)) == 0.0:
                break
            terms = None
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            V.mul_(norms / V.norm(dim=1, keepdim=True).clamp_min(1e-12))
        if step % 50 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
    return V.detach(), losses


class _HingeTerms:
    """The refinement loss restricted to the slots in ``active`` (paper Eq. 5: each slot's squared
    hinge between its worst required anchor and its hardest mined negative; with ``soft_now``, each
    soft anchor's own hinge). Normalised by the whole stream's counts, so that it equals the full
    loss whenever the slots left out meet their margins."""

    def __init__(self, anchors, anchor_owner, soft, hard_h, margin, active, soft_now: bool):
        n = active.shape[0]
        self.n, self.n_soft = n, max(int(soft.sum()), 1)
        self.idx = active.nonzero().squeeze(1)
        remap = torch.full((n,), -1, dtype=torch.long, device=active.device)
        remap[self.idx] = torch.arange(self.idx.numel(), device=active.device)
        hard = ~soft & active[anchor_owner]
        self.hard_a, self.hard_own = anchors[hard], remap[anchor_owner[hard]]
        self.soft_now = soft_now
        keep_soft = soft & active[anchor_owner] if soft_now else torch.zeros_like(soft)
        self.soft_a, self.soft_own = anchors[keep_soft], remap[anchor_owner[keep_soft]]
        self.hard_h, self.margin = hard_h[self.idx], margin[self.idx]

    def _hinges(self, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Va = V[self.idx]
        neg = _hardest_negative(Va, self.hard_h)
        hinge = F.relu(self.margin - min_anchor_scores(Va, self.hard_a, self.hard_own) + neg)
        s_soft = (Va[self.soft_own] * self.soft_a).sum(-1)
        soft_hinge = F.relu(self.margin[self.soft_own] - s_soft + neg[self.soft_own])
        return hinge, soft_hinge

    def loss(self, V: torch.Tensor, soft_weight: float) -> torch.Tensor:
        hinge, soft_hinge = self._hinges(V)
        loss = (hinge**2).sum() / self.n
        if self.soft_now:
            loss = loss + soft_weight * (soft_hinge**2).sum() / self.n_soft
        return loss

    def violating(self, V: torch.Tensor) -> torch.Tensor:
        """Which slots (of the whole stream) have a hinge, required or soft, above zero."""
        hinge, soft_hinge = self._hinges(V)
        out = torch.zeros(self.n, dtype=torch.bool, device=V.device)
        out[self.idx[hinge > 0]] = True
        if self.soft_now:
            out[self.idx[self.soft_own[soft_hinge > 0]]] = True
        return out


def _stop_coasting(opt: torch.optim.Optimizer, V: torch.Tensor, active: torch.Tensor) -> None:
    """Zero Adam's running gradient of the slots left out, so that they stay where they are (a zero
    gradient alone would let the momentum carry them on)."""
    state = opt.state.get(V)
    if state and "exp_avg" in state:
        state["exp_avg"][~active] = 0


@dataclass
class Calibration:
    thresholds: torch.Tensor
    temperatures: torch.Tensor
    separable: torch.Tensor  # bool per slot
    worst_positive: torch.Tensor
    worst_negative: torch.Tensor


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def calibrate(
    V: torch.Tensor,
    anchors: torch.Tensor,
    anchor_owner: torch.Tensor,
    negatives: NegativeSet,
    same_prompt: torch.Tensor,
    gate_eps: float,
    cfg: BuildConfig,
    soft: torch.Tensor | None = None,
) -> Calibration:
    """Stage 5: thresholds and temperatures from the worst anchor and the worst negative of each slot.

    Anchors marked ``soft`` count only where they clear the slot's worst negative by at least
    ``calibration_soft_floor`` of its required anchors' gap: a paraphrase that the address cannot
    separate from a negative is left out rather than opening the gate on that negative."""
    if not 0.0 < cfg.calibration_open_at <= 1.0:
        raise ValueError(f"calibration_open_at must be in (0, 1], got {cfg.calibration_open_at}")
    soft = torch.zeros(anchors.shape[0], dtype=torch.bool, device=anchors.device) if soft is None else soft
    anchors, anchor_owner, soft_a, soft_own = anchors[~soft], anchor_owner[~soft], anchors[soft], anchor_owner[soft]
    s_pos = min_anchor_scores(V, anchors, anchor_owner)
    hard_s, hard_h = negatives.top(V, same_prompt, cfg.refine_hard_negatives)
    s_neg = hard_s[:, 0]
    if soft_own.numel():
        s_soft = (V[soft_own] * soft_a).sum(-1)
        floor = s_neg + cfg.calibration_soft_floor * (s_pos - s_neg)
        counted = (s_soft >= floor[soft_own]) & (s_pos > s_neg)[soft_own]
        s_pos = torch.minimum(s_pos, min_anchor_scores(V, soft_a[counted], soft_own[counted]))
    norms = V.norm(dim=1).clamp_min(1e-12)
    tau, alpha, separable = _closed_form(s_pos, s_neg, norms, gate_eps, cfg)
    bad = (~separable).nonzero().squeeze(1)
    if bad.numel():
        tau_b, alpha_b = _fit_inseparable(
            V[bad], anchors, anchor_owner, bad, hard_h[bad], tau[bad], alpha[bad], cfg
        )
        # Locality first: whatever the fit, the dead zone must still cover every negative but
        # the mined hardest ones, or a slot whose anchors sit among generic states would open
        # on everything.
        tau_b = torch.maximum(tau_b, hard_s[bad, -1] - _logit(gate_eps) / alpha_b)
        tau[bad], alpha[bad] = tau_b, alpha_b
    return Calibration(tau, alpha, separable, s_pos, s_neg)


def _closed_form(s_pos: torch.Tensor, s_neg: torch.Tensor, norms: torch.Tensor, gate_eps: float, cfg: BuildConfig
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thresholds, temperatures and separability from each slot's worst anchor and worst negative
    scores; an inseparable slot gets the midpoint at ``inseparable_temperature``."""
    p_open = gate_eps + cfg.open_gate * (1 - gate_eps)
    z_pos = _logit(p_open)
    # the worst negative lands this many logits below the dead-zone edge: its gate is exactly 0
    z_neg = _logit(gate_eps) - cfg.calibration_negative_slack
    gap = s_pos - s_neg
    separable = gap > 1e-6 * norms
    # the gate reaches open_gate this far from the worst negative towards the worst anchor
    # (1 = at the worst anchor, the paper's calibration; less opens states between the two wider)
    reach = cfg.calibration_open_at * gap
    alpha = torch.where(separable, (z_pos - z_neg) / reach.clamp_min(1e-12), cfg.inseparable_temperature / norms)
    tau = torch.where(separable, s_neg + reach - z_pos / alpha, (s_pos + s_neg) / 2)
    return tau, alpha, separable


def recalibrate(V: torch.Tensor, tau: torch.Tensor, alpha: torch.Tensor, s_pos: torch.Tensor, s_neg: torch.Tensor,
                states: Sequence[torch.Tensor], gate_eps: float, cfg: BuildConfig, chunk: int = 8192
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

    Returns ``(tau, alpha, s_neg, changed)``: the updated (n,) tensors and the indices recalibrated."""
    floor = tau + _logit(gate_eps) / alpha  # scores at or below this are in the dead zone
    best = torch.full_like(s_neg, -math.inf)
    with torch.no_grad():
        for part in states:
            for start in range(0, part.shape[0], chunk):
                s = part[start: start + chunk].to(V) @ V.T
                best = torch.maximum(best, s.masked_fill(s >= s_pos[None, :], -math.inf).amax(0))
    changed = (best > floor).nonzero().squeeze(1)
    tau, alpha, s_neg = tau.clone(), alpha.clone(), s_neg.clone()
    if changed.numel():
        s_neg[changed] = torch.maximum(s_neg[changed], best[changed])
        norms = V[changed].norm(dim=1).clamp_min(1e-12)
        t, a, sep = _closed_form(s_pos[changed], s_neg[changed], norms, gate_eps, cfg)
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
