"""Each slot's anchors and negatives, laid out to be scored against the addresses
(refinement, stage 4, and calibration, stage 5)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .slots import SamePrompt
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
        return NegativeSet(*(t.to(device) for t in (self.shared, self.shared_owner, self.specific, self.specific_owner)))

    def worst(self, V: torch.Tensor, same_prompt: SamePrompt, chunk: int = 512) -> torch.Tensor:
        """max_{h in N_i} v_i^T h for every slot, over the whole set."""
        return self.top(V, same_prompt, 1, chunk)[0][:, 0]

    def top(
        self,
        V: torch.Tensor,
        same_prompt: SamePrompt,
        k: int,
        chunk: int = 512,
        stream_rows: int | None = None,
        candidates: torch.Tensor | None = None,
        slots: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The k hardest negatives of every slot: (scores (n, k), states (n, k, d)). With ``slots``
        the rows of ``V``, ``same_prompt`` and ``candidates`` are those slots only (a distributed
        build's share), in that order.

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
                best_s, best_i = self._merge_specific(V, best_s, best_i, k, slots)
            return best_s, self._states(best_i, V.device)

    def shared_candidates(
        self, V: torch.Tensor, same_prompt: SamePrompt, k: int, chunk: int = 512, stream_rows: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
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
                part = self.shared[lo : lo + step].to(V.device)
                owner = self.shared_owner[lo : lo + step].to(V.device)
                s = V[rows] @ part.T  # (r, M)
                # anchors of the slot itself, and of slots with the same prompt (conflicting targets), are
                # not negatives
                blocked = (owner[None, :] >= 0) & same_prompt[rows].against(owner.clamp_min(0))
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
            idx = candidates[start : start + chunk].to(home).sort(dim=1).values  # CSR: ascending columns per row
            valid = idx >= 0
            rows = torch.zeros(idx.shape[0] + 1, dtype=torch.long, device=home)
            rows[1:] = valid.sum(1).cumsum(0)
            with quiet_sparse():
                pattern = torch.sparse_csr_tensor(
                    rows,
                    idx[valid],
                    torch.zeros(int(rows[-1]), dtype=self.shared.dtype, device=home),
                    size=(idx.shape[0], self.shared.shape[0]),
                    check_invariants=False,
                )
                sampled = torch.sparse.sampled_addmm(pattern, V[start : start + chunk].to(home, self.shared.dtype), self.shared.T)
            s = torch.full(idx.shape, -math.inf, dtype=V.dtype, device=home)
            s[valid] = sampled.values().to(V.dtype)
            vals, pick = s.topk(kk, dim=1)
            best_s[start : start + chunk, :kk] = vals.to(V.device)
            best_i[start : start + chunk, :kk] = idx.gather(1, pick).to(V.device)
        return best_s, best_i.masked_fill(best_s == -math.inf, -1)

    def _merge_specific(self, V, best_s, best_i, k, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each slot's best k among its shared best and its own specific states; a specific state
        is indexed ``len(shared) + j``. One sort by owner and a padded (n, most per slot) table,
        not a scan of all of them per slot. With ``slots``, row r of ``V`` is slot ``slots[r]``."""
        n, m = V.shape[0], self.shared.shape[0]
        owner = self.specific_owner.to(V.device)
        if slots is not None:  # the specific states of these slots only, their owner as a row of V
            slots = slots.to(V.device)
            if slots.numel() == 0:
                return best_s, best_i
            row = torch.full((max(int(owner.max()), int(slots.max())) + 1,), -1, dtype=torch.long, device=V.device)
            row[slots] = torch.arange(slots.numel(), device=V.device)
            kept = (row[owner] >= 0).nonzero().squeeze(1)
            if kept.numel() == 0:
                return best_s, best_i
            owner, specific, index = row[owner[kept]], self.specific[kept.to(self.specific.device)], kept
        else:
            specific, index = self.specific, None
        # in chunks: V[owner] for every specific state would be another copy of them all
        s_spec = torch.cat(
            [
                torch.einsum("sd,sd->s", V[owner[j : j + 16384]], specific[j : j + 16384].to(V.device))
                for j in range(0, specific.shape[0], 16384)
            ]
        )
        order = torch.argsort(owner, stable=True)
        counts = torch.bincount(owner, minlength=n)
        starts = counts.cumsum(0) - counts
        col = torch.arange(int(counts.max()), device=V.device)
        present = col[None, :] < counts[:, None]
        sel = order[(starts[:, None] + col[None, :]).clamp_max(order.numel() - 1)]  # (n, most)
        spec_s = s_spec[sel].masked_fill(~present, -math.inf)
        vals, pick = torch.cat([best_s, spec_s], 1).topk(k, dim=1)
        spec_i = sel if index is None else index.to(V.device)[sel]  # back to indices into all specific states
        index = torch.cat([best_i, (spec_i + m).masked_fill(~present, -1)], 1).gather(1, pick)
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
        return out.reshape(*index.shape, self.shared.shape[1])


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


def negative_set(roll: dict[str, torch.Tensor], base_anchors: torch.Tensor | None = None, chat_slots: int = 0) -> NegativeSet:
    """Anchors and request continuations are negatives of every slot but their own (and those of
    the same prompt, see NegativeSet.top); the corpus pool, and the anchors of the operator an
    append builds on, of every slot. With ``chat_slots`` (the n request slots of a build with chat
    slots) an edit's own negatives are negatives of its chat slot n + i too."""
    everyone = roll["pool"] if base_anchors is None else torch.cat([roll["pool"], base_anchors])
    specific, owner = roll["specific"], roll["specific_owner"]
    if chat_slots:
        specific, owner = torch.cat([specific, specific]), torch.cat([owner, owner + chat_slots])
    return NegativeSet(
        shared=torch.cat([everyone, roll["anchors"], roll["continuations"]]),
        shared_owner=torch.cat(
            [torch.full((everyone.shape[0],), -1, dtype=torch.long), roll["anchor_owner"], roll["continuation_owner"]]
        ),
        specific=specific,
        specific_owner=owner,
    )
