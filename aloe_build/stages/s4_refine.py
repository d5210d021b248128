"""Stage 4: refinement of the addresses (paper Eq. 5).

A squared hinge pushes each address towards its worst anchor and away from its
worst negative; address norms are preserved. The initial addresses (stage 2) are in
:mod:`aloe_build.stages.s2_init`; stage 5, which turns the refined scores into gates,
in :mod:`aloe_build.stages.s5_calibrate`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .. import distributed
from ..checkpoints import PartStore
from ..config import BuildConfig
from ..slot_sets import NegativeSet, SlotAnchors, min_anchor_scores
from ..slots import SamePrompt


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
    same_prompt: SamePrompt,
    cfg: BuildConfig,
    soft: torch.Tensor | None = None,
    parts: PartStore | None = None,
    stats: dict | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """Paper Eq. 5 with hard-negative re-mining; returns refined addresses and the loss curve.

    The steps run until every slot clears its margin against its hardest negatives of the whole
    set, ``refine_steps`` at most: the paper's "up to 3,000 steps". ``stats``, when given, receives
    whether they did (``converged``) and how many slots were mined in full over the run
    (``slots_mined_in_full``; see :class:`_Mining`).

    ``soft`` marks anchors that are wished for rather than required (paraphrases built from
    construction data): they do not enter the worst-anchor hinge; each adds its own squared hinge,
    weighted by ``refine_soft_weight`` and averaged, that turns the address towards it during the
    first two thirds of the steps; the last third restores the required anchors' margin.

    With ``refine_candidates`` the re-minings score each slot's best shared negatives from its
    last full mining and its own negatives, and mine a slot in full again only where those may no
    longer hold its hardest (:class:`_Mining`). With ``parts`` the state at each re-mining is saved
    there, and an interrupted refinement resumes from the last one it reached with the same result.

    With ``refine_pull`` the steps run twice from ``V0``: once with every address pulled back
    towards ``V0`` each step, once without. A slot's loss is its own, so each slot takes its
    pulled address where that one's worst anchor still clears its worst negative (it can be
    calibrated as separable) and its free one elsewhere. The loss curve is the free run's. With
    ``parts`` the pulled run is kept once done, and each run resumes on its own."""
    soft = torch.zeros(anchors.shape[0], dtype=torch.bool, device=anchors.device) if soft is None else soft
    if cfg.experimental.refine_pull <= 0:
        return _refine(V0, 0.0, anchors, anchor_owner, negatives, same_prompt, cfg, soft, parts, "progress", stats)

    def pulled_run() -> dict[str, torch.Tensor]:
        V, _ = _refine(
            V0, cfg.experimental.refine_pull, anchors, anchor_owner, negatives, same_prompt, cfg, soft, parts, "progress-pulled"
        )
        return {"V": V.cpu()}

    # the pulled run first, kept whole once done, so that an interruption of the free run loses neither
    V = (parts.cached("pulled", pulled_run)[0] if parts is not None else pulled_run())["V"].to(V0.device)
    free, losses = _refine(V0, 0.0, anchors, anchor_owner, negatives, same_prompt, cfg, soft, parts, "progress", stats)
    keep = min_anchor_scores(V, anchors[~soft], anchor_owner[~soft]) > negatives.worst(V, same_prompt)
    return torch.where(keep[:, None], V, free), losses


def _refine(
    V0: torch.Tensor,
    pull: float,
    anchors: torch.Tensor,
    anchor_owner: torch.Tensor,
    negatives: NegativeSet,
    same_prompt: SamePrompt,
    cfg: BuildConfig,
    soft: torch.Tensor,
    parts: PartStore | None,
    progress: str,
    stats: dict | None = None,
) -> tuple[torch.Tensor, list[float]]:
    """One run of :func:`refine_addresses`' steps from ``V0``, each step moving the addresses
    ``refine_lr * pull`` of the way back to it; its state saved as ``progress`` in ``parts``."""
    n = V0.shape[0]
    norms = V0.norm(dim=1, keepdim=True).clamp_min(1e-12)
    soft_phase = bool(soft.any()) and cfg.experimental.refine_soft_weight > 0
    soft_steps = (2 * cfg.refine_steps) // 3
    V = V0.clone().requires_grad_(True)
    # fused: one pass over V per step instead of a dozen; a third of the unfused step's time at
    # 1,301 and 7,819 slots, the same addresses within 1e-6 (docs/results.md, "Stage 4 without a per-anchor copy")
    opt = torch.optim.AdamW([V], lr=cfg.refine_lr, weight_decay=0.0, fused=True)
    margin = cfg.refine_margin * norms.squeeze(1)
    _check_settings(cfg)
    mine = _share_mask(n, V.device)
    mining = _Mining(negatives, same_prompt, cfg, mine.nonzero().squeeze(1) if distributed.active() else None)
    progress = distributed.own_name(progress)  # each rank's mining state is its own
    losses: list[float] = []
    hard_h, terms = None, None
    first, at_remine = _resume(parts, progress, V, opt, mining, losses)
    converged = False

    desc = "stage 4: address refinement" + (", pulled to stage 2" if pull else "")
    bar = tqdm(range(first, cfg.refine_steps), total=cfg.refine_steps, initial=first, desc=desc, leave=False)
    for step in bar:
        # the last third runs on the required anchors alone, from freshly mined negatives: it
        # restores the request's margin wherever the pull towards the paraphrases cost it
        soft_now = soft_phase and step < soft_steps
        boundary = soft_phase and step == soft_steps
        remine = hard_h is None or step % cfg.refine_remine_every == 0 or boundary
        if remine:
            if step > first and step % cfg.refine_remine_every == 0:
                _save_progress(parts, progress, step, V, opt, mining, losses, at_remine)
            hard_h = mining.hardest(V)
            terms = None
        if terms is None or boundary or (cfg.refine_active_every > 0 and step % cfg.refine_active_every == 0):
            terms = _step_terms(anchors, anchor_owner, soft, hard_h, margin, soft_now, V, opt, cfg, mine)
        loss = terms.loss(V, cfg.experimental.refine_soft_weight)
        losses.append(float(distributed.summed(loss.detach())))
        if not math.isfinite(losses[-1]):
            raise FloatingPointError("stage 4 (address refinement): loss became NaN/Inf")
        if remine and cfg.experimental.refine_flat_stop > 0 and not soft_now:
            # between re-minings the loss fell by less than refine_flat_stop of itself: the slots
            # still violating are those no step moves (a rise means newly mined negatives: go on)
            if at_remine is not None and (1 - cfg.experimental.refine_flat_stop) * at_remine <= losses[-1] <= at_remine:
                break
            at_remine = losses[-1]
        if losses[-1] == 0.0:
            # every slot clears its margin against the negatives mined at the last re-mining: done
            # once it does against its hardest ones now (the mining is exact), else go on from them
            if not remine:
                hard_h = mining.hardest(V)
            check = _HingeTerms(anchors, anchor_owner, soft, hard_h, margin, mine, False)
            if float(distributed.summed(check.loss(V.detach(), 0.0))) == 0.0:
                converged = True
                break
            terms = None
            continue
        _take_step(V, V0, loss, opt, cfg.refine_lr * pull, norms)
        if step % 50 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
    if stats is not None:
        mined = int(distributed.summed(torch.tensor(mining.full_minings)))
        stats.update(converged=converged, slots_mined_in_full=mined)
    return V.detach(), losses


def _share_mask(n: int, device: torch.device) -> torch.Tensor:
    """The slots this process mines and scores: all, or a distributed build's share (their
    gradients are summed, so that every rank takes the one-process step on all of V)."""
    share = distributed.share(n)
    mine = torch.zeros(n, dtype=torch.bool, device=device)
    mine[share.start : share.stop : share.step] = True
    return mine


def _take_step(
    V: torch.Tensor, V0: torch.Tensor, loss: torch.Tensor, opt: torch.optim.Optimizer, pull: float, norms: torch.Tensor
) -> None:
    """One optimizer step on ``loss``, then ``pull`` of the way back to ``V0`` and each address
    back to its norm (refinement turns addresses, it never scales them)."""
    opt.zero_grad()
    loss.backward()
    if distributed.active():  # each rank's gradient is its slots' rows: their sum is the whole one
        V.grad = distributed.summed(V.grad if V.grad is not None else torch.zeros_like(V))
    opt.step()
    with torch.no_grad():
        if pull:
            V.sub_(pull * (V - V0))
        V.mul_(norms / V.norm(dim=1, keepdim=True).clamp_min(1e-12))


def _check_settings(cfg: BuildConfig) -> None:
    if not 0.0 <= cfg.experimental.refine_flat_stop < 1.0:
        raise ValueError(f"refine_flat_stop must be in [0, 1), got {cfg.experimental.refine_flat_stop}")
    if not 0.0 <= cfg.refine_lr * cfg.experimental.refine_pull < 1.0:
        raise ValueError(f"refine_lr * refine_pull must be in [0, 1), got {cfg.refine_lr * cfg.experimental.refine_pull}")
    if cfg.refine_candidates < 0 or cfg.refine_hard_negatives < 1:
        raise ValueError(
            "refine_candidates must be >= 0 and refine_hard_negatives >= 1, got "
            f"{cfg.refine_candidates} and {cfg.refine_hard_negatives}"
        )


def _step_terms(
    anchors,
    anchor_owner,
    soft,
    hard_h,
    margin,
    soft_now: bool,
    V: torch.Tensor,
    opt: torch.optim.Optimizer,
    cfg: BuildConfig,
    mine: torch.Tensor,
) -> "_HingeTerms":
    """The loss terms of the next steps: every slot of ``mine`` (all, or a distributed build's
    share), or with ``refine_active_every`` those still violating (the others' Adam momentum
    zeroed, so that they stay where they are)."""
    terms = _HingeTerms(anchors, anchor_owner, soft, hard_h, margin, mine, soft_now)
    if cfg.refine_active_every > 0:
        with torch.no_grad():
            active = terms.violating(V)
        terms = _HingeTerms(anchors, anchor_owner, soft, hard_h, margin, active, soft_now)
        _stop_coasting(opt, V, distributed.summed(active.long()) > 0 if distributed.active() else active)
    return terms


class _Mining:
    """The refinement's hard negatives, exact at every re-mining, for far less than scoring every
    shared state each time.

    A full mining scores every shared state and keeps each slot's ``refine_candidates`` best (its
    candidates), the address they were scored at and the lowest candidate score (its floor). A
    re-mining scores only each slot's candidates and own negatives. Shared states have norm at
    most ``radius`` (1: stage 3 stores unit rows), so a state outside a slot's candidates scores at
    most ``floor + radius * |v - v_mined|``; while that bound stays at or below the slot's hardest
    negative among those scored, that one is its hardest of the whole set. A slot whose address has
    moved further is mined in full again, alone. So at every re-mining the hinge sees each slot's
    true hardest negative, however far an address travels (the other k - 1 mined, which stand by
    until the next re-mining, may miss one outside the candidates)."""

    def __init__(self, negatives: NegativeSet, same_prompt: SamePrompt, cfg: BuildConfig, here: torch.Tensor | None = None):
        self.negatives, self.same_prompt, self.cfg = negatives, same_prompt, cfg
        self.here = here  # the slots this process mines (a distributed build's share); None: all
        self.k = cfg.refine_hard_negatives
        self.width = max(cfg.refine_candidates, self.k)
        self.candidates: torch.Tensor | None = None  # (n, width) indices into shared, -1 past the last
        self.mined_at: torch.Tensor | None = None  # (n, d) each slot's address at its last full mining
        self.floor: torch.Tensor | None = None  # (n,) its lowest candidate's score then (-inf: all are candidates)
        self.full_minings = 0  # slots mined in full, counted over the run
        shared = negatives.shared
        self.radius = float(shared.float().norm(dim=1).max()) * (1 + 1e-5) if shared.shape[0] else 0.0

    def hardest(self, V: torch.Tensor) -> torch.Tensor:
        """States (n, refine_hard_negatives, d) of each slot's hardest negatives now, the first of
        them exact (the hinge's; the others stand by for the steps until the next re-mining)."""
        V = V.detach()
        n, here = V.shape[0], self.here
        rows = torch.arange(n, device=V.device) if here is None else here
        if self.cfg.refine_candidates <= 0:
            self.full_minings += int(rows.numel())
            return self._spread(self._top(V, None)[1], n)
        if self.candidates is None:
            self.candidates = torch.full((n, self.width), -1, dtype=torch.long, device=V.device)
            self.mined_at, self.floor = torch.zeros_like(V), torch.full((n,), -math.inf, dtype=V.dtype, device=V.device)
            self._mine_in_full(V, rows)
        scores, states = self._top(V, self.candidates)
        with torch.no_grad():
            reach = self.floor[rows] + self.radius * (V[rows] - self.mined_at[rows]).norm(dim=1)
            stale = rows[(reach > scores[:, 0]).nonzero().squeeze(1)]
        if stale.numel():
            self._mine_in_full(V, stale)
            scores, states = self._top(V, self.candidates)
        return self._spread(states, n)

    def _top(self, V: torch.Tensor, candidates: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`NegativeSet.top` of the slots mined here."""
        if self.here is None:
            return self.negatives.top(V, self.same_prompt, self.k, candidates=candidates)
        h = self.here
        return self.negatives.top(
            V[h], self.same_prompt[h], self.k, candidates=None if candidates is None else candidates[h], slots=h
        )

    def _spread(self, states: torch.Tensor, n: int) -> torch.Tensor:
        """The states of the slots mined here at their rows of all ``n`` (zeros elsewhere)."""
        if self.here is None:
            return states
        out = torch.zeros(n, *states.shape[1:], dtype=states.dtype, device=states.device)
        out[self.here] = states
        return out

    def _mine_in_full(self, V: torch.Tensor, rows: torch.Tensor) -> None:
        """Score every shared state for the slots ``rows`` and keep their candidates."""
        s, idx = self.negatives.shared_candidates(V[rows], self.same_prompt[rows], self.width)
        self.candidates[rows] = idx
        self.mined_at[rows] = V[rows]
        # a slot with fewer shared negatives than candidates has them all: nothing outside to bound
        self.floor[rows] = torch.where(idx[:, -1] >= 0, s[:, -1], -math.inf)
        self.full_minings += int(rows.numel())

    def state(self) -> dict[str, torch.Tensor]:
        """What :meth:`restore` needs to go on exactly where this mining is."""
        if self.candidates is None:
            return {}
        return {
            "candidates": self.candidates,
            "mined_at": self.mined_at,
            "floor": self.floor,
            "full_minings": torch.tensor(self.full_minings),
        }

    def restore(self, saved: dict[str, torch.Tensor], device: torch.device) -> None:
        if "mined_at" in saved:  # saved by a run that kept the bound's state
            self.candidates, self.mined_at, self.floor = (saved[k].to(device) for k in ("candidates", "mined_at", "floor"))
            self.full_minings = int(saved["full_minings"])


def _save_progress(
    parts: PartStore | None,
    name: str,
    step: int,
    V: torch.Tensor,
    opt: torch.optim.Optimizer,
    mining: _Mining,
    losses: list[float],
    at_remine: float | None,
) -> None:
    """The refinement's state at the start of ``step`` (a re-mining step), saved as ``name``."""
    if parts is None:
        return
    state = opt.state.get(V, {})
    tensors = {
        "step": torch.tensor(step),
        "V": V.detach(),
        "losses": torch.tensor(losses, dtype=torch.float64),
        "at_remine": torch.tensor(math.nan if at_remine is None else at_remine, dtype=torch.float64),
    }
    tensors.update({f"adam_{name}": torch.as_tensor(value) for name, value in state.items()})
    tensors.update(mining.state())
    parts.put(name, {key: t.cpu() for key, t in tensors.items()})


def _resume(
    parts: PartStore | None, name: str, V: torch.Tensor, opt: torch.optim.Optimizer, mining: _Mining, losses: list[float]
) -> tuple[int, float | None]:
    """Restore the state saved by :func:`_save_progress` as ``name``; returns the step to go on from
    (0: none) and the loss at the last re-mining."""
    saved = parts.get(name) if parts is not None else None
    if saved is None:
        return 0, None
    with torch.no_grad():
        V.copy_(saved["V"].to(V.device))
    # the fused optimizer keeps its step count on the parameter's device too
    state = {name[len("adam_") :]: t.to(V.device) for name, t in saved.items() if name.startswith("adam_")}
    if state:
        opt.state[V] = state
    mining.restore(saved, V.device)
    losses += saved["losses"].tolist()
    at_remine = float(saved["at_remine"])
    return int(saved["step"]), None if math.isnan(at_remine) else at_remine


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
        rows = hard.nonzero().squeeze(1)
        self.hard = SlotAnchors(anchors, remap[anchor_owner[rows]], self.idx.numel(), rows)
        self.soft_now = soft_now
        keep_soft = soft & active[anchor_owner] if soft_now else torch.zeros_like(soft)
        self.soft_a, self.soft_own = anchors[keep_soft], remap[anchor_owner[keep_soft]]
        self.hard_h, self.margin = hard_h[self.idx], margin[self.idx]

    def _hinges(self, V: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        Va = V[self.idx]
        neg = _hardest_negative(Va, self.hard_h)
        hinge = F.relu(self.margin - self.hard.min_scores(Va) + neg)
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
