"""Stages 2 and 4: the addresses and their refinement.

(2) v_i = c Q^T norm(K h(t_i)) from the request state.
(4) Paper Eq. 5: a squared hinge pushes each address towards its worst
    anchor and away from its worst negative; address norms are preserved.
Stage 5, which turns the refined scores into gates, is in :mod:`aloe_build.calibration`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from .checkpoints import PartStore
from .config import BuildConfig
from .sparse_warnings import quiet_sparse


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
            stream_rows: int | None = None, candidates: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k hardest negatives of every slot: (scores (n, k), states (n, k, d)).

        The shared states scored are all of them, or with ``candidates`` (from
        :meth:`shared_candidates`) only each slot's own candidates: an index that the refinement
        mines from between its full passes. The set may live on another device than ``V`` (a GPU
        build keeps large sets on CPU): it is then read in pieces of ``stream_rows`` states
        (65,536 by default)."""
        with torch.no_grad():
            if candidates is None:
                best_s, best_i = self._shared_top(V, same_prompt, k, chunk, stream_rows)
            else:
                best_s, best_i = self._candidate_top(V, candidates, k)
            if self.specific.shape[0]:
                best_s, best_i = self._merge_specific(V, best_s, best_i, k)
            return best_s, self._states(best_i, V.device)

    def shared_candidates(self, V: torch.Tensor, same_prompt: torch.Tensor, k: int, chunk: int = 512,
                          stream_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores and indices (n, k) into ``shared`` of each slot's k highest-scoring shared states
        that are its negatives, best first (-inf and -1 where it has fewer)."""
        with torch.no_grad():
            return self._shared_top(V, same_prompt, k, chunk, stream_rows)

    def _shared_top(self, V, same_prompt, k, chunk, stream_rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores and indices into ``shared`` of each slot's k best shared negatives (-inf and -1
        where it has fewer)."""
        n = V.shape[0]
        best_s = torch.full((n, k), -math.inf, dtype=V.dtype, device=V.device)
        best_i = torch.full((n, k), -1, dtype=torch.long, device=V.device)
        # states held elsewhere (a GPU build whose negatives stay on CPU) come over in pieces
        step = max(1, stream_rows or (self.shared.shape[0] if self.shared.device == V.device else 65536))
        for start in range(0, n, chunk):
            rows = torch.arange(start, min(n, start + chunk), device=V.device)
            for lo in range(0, self.shared.shape[0], step):
                part = self.shared[lo: lo + step].to(V.device)
                owner = self.shared_owner[lo: lo + step].to(V.device)
                s = V[rows] @ part.T  # (r, M)
                # anchors of the slot itself, and of slots with the same prompt (conflicting targets), are
                # not negatives
                blocked = (owner[None, :] >= 0) & same_prompt[rows][:, owner.clamp_min(0)]
                s = s.masked_fill(blocked, -math.inf)
                vals, idx = s.topk(min(k, s.shape[1]), dim=1)
                # merge this piece's best with the best so far
                vals, pick = torch.cat([best_s[rows], vals], 1).topk(k, dim=1)
                best_s[rows], best_i[rows] = vals, torch.cat([best_i[rows], idx + lo], 1).gather(1, pick)
        return best_s, best_i.masked_fill(best_s == -math.inf, -1)

    def _candidate_top(self, V, candidates, k, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`_shared_top`, scoring each slot's candidates only: a sampled product (only the
        (slot, candidate) entries of V @ shared^T, read in place), about four times faster on CPU
        than gathering every slot's candidate states first. Computed where ``shared`` lives."""
        n, kk = V.shape[0], min(k, candidates.shape[1])
        best_s = torch.full((n, k), -math.inf, dtype=V.dtype, device=V.device)
        best_i = torch.full((n, k), -1, dtype=torch.long, device=V.device)
        home = self.shared.device
        for start in range(0, n, chunk):
            idx = candidates[start: start + chunk].to(home).sort(dim=1).values  # CSR: ascending columns per row
            valid = idx >= 0
            rows = torch.zeros(idx.shape[0] + 1, dtype=torch.long, device=home)
            rows[1:] = valid.sum(1).cumsum(0)
            with quiet_sparse():
                pattern = torch.sparse_csr_tensor(rows, idx[valid], torch.zeros(int(rows[-1]), dtype=self.shared.dtype,
                                                  device=home), size=(idx.shape[0], self.shared.shape[0]),
                                                  check_invariants=False)
                sampled = torch.sparse.sampled_addmm(pattern, V[start: start + chunk].to(home, self.shared.dtype),
                                                     self.shared.T)
            s = torch.full(idx.shape, -math.inf, dtype=V.dtype, device=home)
            s[valid] = sampled.values().to(V.dtype)
            vals, pick = s.topk(kk, dim=1)
            best_s[start: start + chunk, :kk] = vals.to(V.device)
            best_i[start: start + chunk, :kk] = idx.gather(1, pick).to(V.device)
        return best_s, best_i.masked_fill(best_s == -math.inf, -1)

    def _merge_specific(self, V, best_s, best_i, k) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's best k among its shared best and its own specific states; a specific state
        is indexed ``len(shared) + j``. One sort by owner and a padded (n, most per slot) table,
        not a scan of all of them per slot."""
        n, m = V.shape[0], self.shared.shape[0]
        owner = self.specific_owner.to(V.device)
        # in chunks: V[owner] for every specific state would be another copy of them all
        s_spec = torch.cat([
            torch.einsum("sd,sd->s", V[owner[j: j + 16384]], self.specific[j: j + 16384].to(V.device))
            for j in range(0, self.specific.shape[0], 16384)])
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=n)
        starts = counts.cumsum(0) - counts
        col = torch.arange(int(counts.max()), device=V.device)
        present = col[None, :] < counts[:, None]
        sel = order[(starts[:, None] + col[None, :]).clamp_max(order.numel() - 1)]  # (n, most)
        spec_s = s_spec[sel].masked_fill(~present, -math.inf)
        vals, pick = torch.cat([best_s, spec_s], 1).topk(k, dim=1)
        index = torch.cat([best_i, (sel + m).masked_fill(~present, -1)], 1).gather(1, pick)
        return vals, index.masked_fill(vals == -math.inf, -1)

    def _states(self, index: torch.Tensor, device: torch.device) -> torch.Tensor:
        """The states (n, k, d) of combined indices (shared, then specific; zeros for -1)."""
        m = self.shared.shape[0]
        flat = index.reshape(-1).to(self.shared.device)
        out = torch.zeros(flat.numel(), self.shared.shape[1], dtype=self.shared.dtype, device=device)
        for source, chosen, offset in ((self.shared, (flat >= 0) & (flat < m), 0), (self.specific, flat >= m, m)):
            rows = chosen.nonzero().squeeze(1)
            if rows.numel():
                out[rows.to(device)] = source[(flat[rows] - offset).to(source.device)].to(device)
        return out.reshape(*index.shape, -1)


class SlotAnchors:
    """Each slot's anchors laid out for the minimum over them: the slots with c anchors as one
    (slots, c, d) block per count c, in the anchors' order. A refinement step then scores every
    anchor against its own slot's address by one batched product per count, reading each state once,
    where gathering a copy of the address for every anchor wrote a fresh (anchors, d) block per step
    (0.29 of stage 4's time on the 1,301-edit CounterFact build)."""

    def __init__(self, anchors: torch.Tensor, owner: torch.Tensor, n: int, rows: torch.Tensor | None = None):
        """``owner[k]`` (< n) is the slot of anchor ``anchors[k]``, or with ``rows`` of ``anchors[rows[k]]``
        (the anchors of a subset, gathered once into the blocks)."""
        counts = torch.bincount(owner, minlength=n)
        self.has = counts > 0  # slots with an anchor (the others score +inf)
        order = torch.argsort(owner, stable=True)  # each slot's anchors in their own order
        starts = torch.cumsum(counts, 0) - counts
        self.groups: list[tuple[torch.Tensor, torch.Tensor]] = []
        for c in counts.unique().tolist():
            if c == 0:
                continue
            slots = (counts == c).nonzero().squeeze(1)
            index = order[starts[slots, None] + torch.arange(c, device=owner.device)]
            self.groups.append((slots, anchors[index if rows is None else rows[index]]))

    def min_scores(self, V: torch.Tensor) -> torch.Tensor:
        """min_{h in P_i} v_i^T h for every slot (+inf for a slot without anchors). The minimising
        anchor (the first of equals) is found without autograd, and the gradient flows through one
        dot product per slot, the gradient of ``min``."""
        chosen = torch.zeros_like(V)
        with torch.no_grad():
            for slots, block in self.groups:
                j = torch.einsum("scd,sd->sc", block, V[slots]).argmin(1)
                chosen[slots] = block[torch.arange(len(slots), device=V.device), j]
        return torch.where(self.has, (chosen * V).sum(-1), math.inf)


def min_anchor_scores(V: torch.Tensor, anchors: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
    """min_{h in P_i} v_i^T h for every slot (+inf for a slot without anchors), with the gradient of
    ``min`` (:class:`SlotAnchors`; build one and reuse it where the anchors stay the same)."""
    return SlotAnchors(anchors, owner, V.shape[0]).min_scores(V)


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
    if cfg.refine_pull <= 0:
        return _refine(V0, 0.0, anchors, anchor_owner, negatives, same_prompt, cfg, soft, parts, "progress", stats)

    def pulled_run() -> dict[str, torch.Tensor]:
        V, _ = _refine(V0, cfg.refine_pull, anchors, anchor_owner, negatives, same_prompt, cfg, soft, parts,
                       "progress-pulled")
        return {"V": V.cpu()}

    # the pulled run first, kept whole once done, so that an interruption of the free run loses neither
    V = (parts.cached("pulled", pulled_run)[0] if parts is not None else pulled_run())["V"].to(V0.device)
    free, losses = _refine(V0, 0.0, anchors, anchor_owner, negatives, same_prompt, cfg, soft, parts, "progress",
                           stats)
    keep = min_anchor_scores(V, anchors[~soft], anchor_owner[~soft]) > negatives.worst(V, same_prompt)
    return torch.where(keep[:, None], V, free), losses


def _refine(V0: torch.Tensor, pull: float, anchors: torch.Tensor, anchor_owner: torch.Tensor,
            negatives: NegativeSet, same_prompt: torch.Tensor, cfg: BuildConfig, soft: torch.Tensor,
            parts: PartStore | None, progress: str, stats: dict | None = None) -> tuple[torch.Tensor, list[float]]:
    """One run of :func:`refine_addresses`' steps from ``V0``, each step moving the addresses
    ``refine_lr * pull`` of the way back to it; its state saved as ``progress`` in ``parts``."""
    n = V0.shape[0]
    norms = V0.norm(dim=1, keepdim=True).clamp_min(1e-12)
    soft_phase = bool(soft.any()) and cfg.refine_soft_weight > 0
    soft_steps = (2 * cfg.refine_steps) // 3
    V = V0.clone().requires_grad_(True)
    # fused: one pass over V per step instead of a dozen; a third of the unfused step's time at
    # 1,301 and 7,819 slots, the same addresses within 1e-6 (docs/results.md, "Stage 4 without a per-anchor copy")
    opt = torch.optim.AdamW([V], lr=cfg.refine_lr, weight_decay=0.0, fused=True)
    margin = cfg.refine_margin * norms.squeeze(1)
    _check_settings(cfg)
    mining = _Mining(negatives, same_prompt, cfg)
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
            terms = _step_terms(anchors, anchor_owner, soft, hard_h, margin, soft_now, V, opt, cfg)
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
        if losses[-1] == 0.0:
            # every slot clears its margin against the negatives mined at the last re-mining: done
            # once it does against its hardest ones now (the mining is exact), else go on from them
            if not remine:
                hard_h = mining.hardest(V)
            check = _HingeTerms(anchors, anchor_owner, soft, hard_h, margin, torch.ones(n, dtype=torch.bool,
                                device=V.device), False)
            if float(check.loss(V.detach(), 0.0)) == 0.0:
                converged = True
                break
            terms = None
            continue
        opt.zero_grad()
        loss.backward()
        opt.step()
        with torch.no_grad():
            if pull:
                V.sub_(cfg.refine_lr * pull * (V - V0))
            V.mul_(norms / V.norm(dim=1, keepdim=True).clamp_min(1e-12))
        if step % 50 == 0:
            bar.set_postfix(loss=f"{losses[-1]:.4g}")
    if stats is not None:
        stats.update(converged=converged, slots_mined_in_full=mining.full_minings)
    return V.detach(), losses


def _check_settings(cfg: BuildConfig) -> None:
    if not 0.0 <= cfg.refine_flat_stop < 1.0:
        raise ValueError(f"refine_flat_stop must be in [0, 1), got {cfg.refine_flat_stop}")
    if not 0.0 <= cfg.refine_lr * cfg.refine_pull < 1.0:
        raise ValueError(f"refine_lr * refine_pull must be in [0, 1), got {cfg.refine_lr * cfg.refine_pull}")
    if cfg.refine_candidates < 0 or cfg.refine_hard_negatives < 1:
        raise ValueError("refine_candidates must be >= 0 and refine_hard_negatives >= 1, got "
                         f"{cfg.refine_candidates} and {cfg.refine_hard_negatives}")


def _step_terms(anchors, anchor_owner, soft, hard_h, margin, soft_now: bool, V: torch.Tensor,
                opt: torch.optim.Optimizer, cfg: BuildConfig) -> "_HingeTerms":
    """The loss terms of the next steps: every slot, or with ``refine_active_every`` the slots still
    violating (the others' Adam momentum zeroed, so that they stay where they are)."""
    everything = torch.ones(V.shape[0], dtype=torch.bool, device=V.device)
    terms = _HingeTerms(anchors, anchor_owner, soft, hard_h, margin, everything, soft_now)
    if cfg.refine_active_every > 0:
        with torch.no_grad():
            active = terms.violating(V)
        terms = _HingeTerms(anchors, anchor_owner, soft, hard_h, margin, active, soft_now)
        _stop_coasting(opt, V, active)
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

    def __init__(self, negatives: NegativeSet, same_prompt: torch.Tensor, cfg: BuildConfig):
        self.negatives, self.same_prompt, self.cfg = negatives, same_prompt, cfg
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
        if self.cfg.refine_candidates <= 0:
            self.full_minings += V.shape[0]
            return self.negatives.top(V, self.same_prompt, self.k)[1]
        if self.candidates is None:
            n = V.shape[0]
            self.candidates = torch.full((n, self.width), -1, dtype=torch.long, device=V.device)
            self.mined_at, self.floor = torch.zeros_like(V), torch.full((n,), -math.inf, dtype=V.dtype,
                                                                          device=V.device)
            self._mine_in_full(V, torch.arange(n, device=V.device))
        scores, states = self.negatives.top(V, self.same_prompt, self.k, candidates=self.candidates)
        with torch.no_grad():
            reach = self.floor + self.radius * (V - self.mined_at).norm(dim=1)
            stale = (reach > scores[:, 0]).nonzero().squeeze(1)
        if stale.numel():
            self._mine_in_full(V, stale)
            scores, states = self.negatives.top(V, self.same_prompt, self.k, candidates=self.candidates)
        return states

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
        return {"candidates": self.candidates, "mined_at": self.mined_at, "floor": self.floor,
                "full_minings": torch.tensor(self.full_minings)}

    def restore(self, saved: dict[str, torch.Tensor], device: torch.device) -> None:
        if "mined_at" in saved:  # saved by a run that kept the bound's state
            self.candidates, self.mined_at, self.floor = (saved[k].to(device) for k in ("candidates", "mined_at",
                                                                                      "floor"))
            self.full_minings = int(saved["full_minings"])


def _save_progress(parts: PartStore | None, name: str, step: int, V: torch.Tensor, opt: torch.optim.Optimizer,
                   mining: _Mining, losses: list[float], at_remine: float | None) -> None:
    """The refinement's state at the start of ``step`` (a re-mining step), saved as ``name``."""
    if parts is None:
        return
    state = opt.state.get(V, {})
    tensors = {"step": torch.tensor(step), "V": V.detach(), "losses": torch.tensor(losses, dtype=torch.float64),
               "at_remine": torch.tensor(math.nan if at_remine is None else at_remine, dtype=torch.float64)}
    tensors.update({f"adam_{name}": torch.as_tensor(value) for name, value in state.items()})
    tensors.update(mining.state())
    parts.put(name, {key: t.cpu() for key, t in tensors.items()})


def _resume(parts: PartStore | None, name: str, V: torch.Tensor, opt: torch.optim.Optimizer, mining: _Mining,
            losses: list[float]) -> tuple[int, float | None]:
    """Restore the state saved by :func:`_save_progress` as ``name``; returns the step to go on from
    (0: none) and the loss at the last re-mining."""
    saved = parts.get(name) if parts is not None else None
    if saved is None:
        return 0, None
    with torch.no_grad():
        V.copy_(saved["V"].to(V.device))
    # the fused optimizer keeps its step count on the parameter's device too
    state = {name[len("adam_"):]: t.to(V.device) for name, t in saved.items() if name.startswith("adam_")}
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
