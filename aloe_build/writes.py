"""Stages 6-8: fit the write directions U once the gates are fixed.

(6) Write targets: for each edit, the down-projection output change that makes
    the model produce the target, optimised on its own for a few steps. The
    change is applied through the edit's own calibrated gate at every position
    of prompt + target, i.e. in exactly the form the operator can express
    (a rank-one change along the gate), so the "compress to rank 16, evaluate
    on the anchor" step of the paper reduces to reading the vector off.
(7) Paper Eq. 6: one ridge solve for all writes, accounting for edits whose
    gates overlap and keeping writes small where negatives open a gate.
(8) A few AdamW steps of target NLL on U with V, tau, alpha frozen, on
    minibatches of edits with the whole operator in place.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm.auto import tqdm

from aloe_kernels import AloeOperator
from aloe_kernels.reference import gates_from_scores

from .checkpoints import PartStore
from .config import BuildConfig
from .edited_forward import EditedForward
from .open_gates import OpenGates, add_gram_, open_gates


def edited_forward(model, tokenizer, seqs: Sequence[Sequence[int]], target_lens: Sequence[int],
                   owners: Sequence[int], op: AloeOperator, cfg: BuildConfig) -> EditedForward:
    """The shared forward of stages 6 and 8 (gates depend only on V, tau, alpha, fixed by then).
    Sequence i < op.n is slot i's request; later ones are extra sequences of slot ``owners[i]``."""
    return EditedForward(model, tokenizer, seqs, target_lens, op, cfg.batch_size, cfg.compute_dtype,
                         desc="stages 6-8: gates and layer outputs", owners=owners)


def write_targets(fwd: EditedForward, cfg: BuildConfig, parts: PartStore | None = None,
                  rows_of: Sequence[Sequence[int]] | None = None, stats: dict | None = None
                  ) -> tuple[torch.Tensor, list[float], float]:
    """Stage 6: for slot i, delta_i (d_out) minimising the target NLL of its sequences with out += g_i(h) delta_i.

    ``rows_of[i]`` lists the sequences of ``fwd`` that slot i's delta is fitted on (default: its
    request, sequence i); with several, the loss is the mean of their NLLs and the slot counts as
    produced once every one of them is. Each batch runs ``target_steps`` steps, then keeps going
    (up to ``target_max_steps``) on the edits not yet produced greedily; an edit leaves the batch
    once it is, with the delta of that step. Returns the deltas, each edit's final NLL (mean over
    its sequences) and the share produced. With ``parts`` each batch is saved as it finishes and
    read back when the stage resumes. ``stats``, when given, receives the slots whose target is not
    produced (``unproduced_slots``), the optimiser steps per batch (``steps_mean``, ``steps_max``) and
    how many batches ran past ``target_steps`` (``batches_past_target_steps``), over the batches that
    recorded them.
    """
    if min(cfg.target_l2, cfg.target_steps, cfg.target_max_steps, cfg.target_stop_nll) < 0:
        raise ValueError("target_l2, target_steps, target_max_steps and target_stop_nll must be >= 0")
    n = fwd.n_slots
    rows_of = [[i] for i in range(n)] if rows_of is None else [list(r) for r in rows_of]
    if len(rows_of) != n or not all(rows_of):
        raise ValueError(f"rows_of must give at least one sequence for each of the {n} slots")
    deltas = torch.zeros(n, fwd.d_out)
    final_losses = [0.0] * n
    produced = [False] * n
    batches = target_batches(fwd, rows_of, cfg.target_batch)
    saved = {k for k in range(len(batches)) if parts is not None and parts.has(f"batch-{k}")}
    steps: list[int] = []
    # the bar starts past the batches read back: its rate and time left are this run's
    bar = tqdm(total=len(batches), initial=len(saved), desc="stage 6: write targets", leave=False)
    with fwd.frozen(), bar:
        for k, slots in enumerate(batches):
            piece = parts.get(f"batch-{k}") if k in saved else None
            if piece is not None and not torch.equal(piece.get("slots", torch.empty(0)), torch.tensor(slots)):
                piece = None  # saved by a run that formed its batches otherwise
            if piece is None:
                piece = _target_batch(fwd, [rows_of[i] for i in slots], cfg)
                piece["slots"] = torch.tensor(slots)
                if parts is not None:
                    parts.put(f"batch-{k}", piece)
                bar.update(1)
            deltas[slots] = piece["delta"]
            if "steps" in piece:  # batches saved before the count was kept have none
                steps.append(int(piece["steps"]))
            for i, v, e in zip(slots, piece["nll"].tolist(), piece["produced"].tolist()):
                final_losses[i], produced[i] = v, bool(e)
            bar.set_postfix(nll=f"{float(piece['nll'].mean()):.3f}")
    if stats is not None:
        stats["unproduced_slots"] = [i for i, made in enumerate(produced) if not made]
        if steps:
            stats.update(steps_mean=sum(steps) / len(steps), steps_max=max(steps),
                         batches_past_target_steps=sum(k > cfg.target_steps for k in steps))
    return deltas, final_losses, sum(produced) / max(n, 1)


def target_batches(fwd: EditedForward, rows_of: Sequence[Sequence[int]], size: int) -> list[list[int]]:
    """Stage 6's batches of slots. A step pads every sequence of a batch to the longest run of
    positions after a cached prefix (``EditedForward.upper_positions``), so slots are ordered by
    theirs: ordered by whole length, one sequence whose gates open early widens its batch, and
    the more slots an operator has, the more batches hold one. Each slot's delta has its own loss
    and its own Adam moments, so the grouping does not change what is fitted."""
    def cost(i: int) -> tuple[int, int]:
        return (max(fwd.upper_positions(r) for r in rows_of[i]), max(len(fwd.seqs[r]) for r in rows_of[i]))

    order = sorted(range(len(rows_of)), key=cost)
    return [order[start: start + size] for start in range(0, len(order), size)]


def _target_batch(fwd: EditedForward, rows_of: list[list[int]], cfg: BuildConfig) -> dict[str, torch.Tensor]:
    """Stage 6 for one batch of slots (``rows_of[b]``: the sequences of the b-th): their deltas,
    final NLLs (mean over each slot's sequences), whether each is produced, and the optimiser
    steps the batch took."""
    B = len(rows_of)
    delta = torch.zeros(B, fwd.d_out, device=fwd.device, requires_grad=True)
    out = torch.zeros(B, fwd.d_out)
    nll_out = torch.zeros(B)
    produced = torch.zeros(B, dtype=torch.bool)
    opt = torch.optim.Adam([delta], lr=cfg.target_lr)
    live = list(range(B))  # batch positions still optimised

    def flatten(live: list[int]) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The sequences of the live slots, the live position of each, how many each live slot has,
        and the live slots' gates on their sequences."""
        rows = [r for b in live for r in rows_of[b]]
        at = torch.tensor([k for k, b in enumerate(live) for _ in rows_of[b]], device=fwd.device)
        count = torch.tensor([float(len(rows_of[b])) for b in live], device=fwd.device)
        return rows, at, count, fwd.own_gates(rows)[..., None]  # gates (R, W, 1)

    rows, at, count, g = flatten(live)
    for step in range(max(cfg.target_steps, cfg.target_max_steps) + 1):
        nll_rows, exact_rows = fwd.scored(rows, g * delta[live][at][:, None, :])
        nll = torch.zeros(len(live), device=fwd.device).index_add(0, at, nll_rows) / count
        missed = torch.zeros(len(live), device=fwd.device).index_add(0, at, (~exact_rows).float().to(fwd.device))
        exact = (missed == 0).cpu()
        # record the deltas just scored: an edit that leaves keeps the delta that produced it
        out[live] = delta.detach()[live].float().cpu()
        nll_out[live] = nll.detach().float().cpu()
        produced[live] = exact
        # produced edits leave: after target_steps every one, before it those whose NLL is at most
        # target_stop_nll (none when that is 0)
        limit = math.inf if step >= cfg.target_steps else (cfg.target_stop_nll or -math.inf)
        keep = ~(exact & (nll.detach().cpu() <= limit))
        if not keep.any() or step >= max(cfg.target_steps, cfg.target_max_steps):
            break
        if not keep.all():  # some edits left: a smaller batch from here on
            live = [b for b, k in zip(live, keep.tolist()) if k]
            rows, at, count, g = flatten(live)
            nll = nll[keep.to(nll.device)]
        loss = nll.sum() + cfg.target_l2 * (delta[live] ** 2).sum()
        if not torch.isfinite(loss):
            raise FloatingPointError("stage 6 (write targets): loss became NaN/Inf")
        opt.zero_grad()
        loss.backward()
        opt.step()
    # the loop stops at step k before its update (or after the last one): k updates were made
    return {"delta": out, "nll": nll_out, "produced": produced, "steps": torch.tensor(step)}


def gates_of(states: torch.Tensor, op: AloeOperator, chunk: int = 8192) -> torch.Tensor:
    """Gates (N, n) of normalized states, in float32."""
    V, tau, alpha = (t.float() for t in (op.addresses, op.thresholds, op.temperatures))
    out = []
    for start in range(0, states.shape[0], chunk):
        s = states[start: start + chunk].float() @ V.T
        out.append(gates_from_scores(s, tau, alpha, op.gate_eps))
    return torch.cat(out) if out else torch.zeros(0, op.n)


@dataclass
class NegativeGateTally:
    """Of the negative states gated so far: how many, how many open any gate, the largest gate."""

    rows: int = 0
    any_open: int = 0
    max_gate: float = 0.0

    def add(self, gates: OpenGates) -> None:
        self.rows += gates.n_rows
        self.any_open += int(torch.unique_consecutive(gates.rows).numel())
        self.max_gate = max(self.max_gate, float(gates.values.max()) if gates.values.numel() else 0.0)

    def summary(self) -> dict[str, float]:
        return {"negative_any_open_share": self.any_open / self.rows if self.rows else 0.0,
                "negative_max_gate": self.max_gate}


def ridge_writes(
    deltas: torch.Tensor,
    anchors: torch.Tensor,
    anchor_owner: torch.Tensor,
    negatives: torch.Tensor | Sequence[torch.Tensor],
    op: AloeOperator,
    cfg: BuildConfig,
    tally: NegativeGateTally | None = None,
) -> torch.Tensor:
    """Stage 7 (paper Eq. 6): U0 = Y G+^T (G+ G+^T + lambda G- G-^T + mu I)^-1, edit-major.

    Column a of Y is what anchor a should receive: its own slot's gate times that slot's target.
    ``negatives`` may be several tensors (read in place, never concatenated). Gating every
    negative at every slot is the stage's cost, so ``tally``, if given, also counts their gates
    (the build report's gate statistics need the same pass). Only the open gates are kept
    (:mod:`.open_gates`): the products cost what the open gates do, not N times n.
    """
    A = cfg.ridge_mu * torch.eye(op.n, dtype=torch.float64)
    rhs = torch.zeros(op.n, deltas.shape[1], dtype=torch.float64)  # G+^T Y
    targets = deltas.double()
    lo = 0
    for Gp in open_gates(anchors, op):
        owner = anchor_owner[lo: lo + Gp.n_rows]
        lo += Gp.n_rows
        Y = Gp.at(owner).double()[:, None] * targets[owner]  # (piece, d_out)
        S = Gp.sparse(op.n)
        add_gram_(A, S)
        rhs += torch.sparse.mm(S.t(), Y)
    for Gn in open_gates(negatives, op):
        if tally is not None:
            tally.add(Gn)
        add_gram_(A, Gn.sparse(op.n), cfg.ridge_lambda)
    writes = torch.linalg.solve(A, rhs)  # (n, d_out)
    if not torch.isfinite(writes).all():
        raise FloatingPointError("stage 7 (ridge solve): writes became NaN/Inf")
    return writes.float()


def finetune_writes(fwd: EditedForward, writes: torch.Tensor, cfg: BuildConfig) -> tuple[torch.Tensor, list[float]]:
    """Stage 8: AdamW on U for target NLL over minibatches of edits, the whole operator in place.

    With ``finetune_rescore_every`` > 0 the minibatches come from the sequences whose target the
    current writes do not yet produce, re-scored that often; training stops once all are produced.
    """
    if cfg.finetune_rescore_every < 0:
        raise ValueError(f"finetune_rescore_every must be >= 0, got {cfg.finetune_rescore_every}")
    if cfg.finetune_steps <= 0:
        return writes.clone(), []
    rng = random.Random(cfg.seed)
    losses: list[float] = []
    U = writes.detach().to(fwd.device, torch.float32).clone().requires_grad_(True)
    opt = torch.optim.AdamW([U], lr=cfg.finetune_lr, weight_decay=0.0)
    everything = list(range(len(fwd.seqs)))
    order = everything[:]  # re-drawn from the missed sequences when rescoring
    if cfg.finetune_rescore_every == 0:
        rng.shuffle(order)
    pos = 0
    bar = tqdm(range(cfg.finetune_steps), desc="stage 8: write fine-tuning", leave=False)
    with fwd.frozen():
        for step in bar:
            if cfg.finetune_rescore_every > 0 and step % cfg.finetune_rescore_every == 0:
                order = [i for i, ok in zip(everything, produced_rows(fwd, U.detach(), everything, cfg.finetune_batch))
                         if not ok]
                if not order:
                    break  # every target is produced
                rng.shuffle(order)
                pos = 0
            if pos + cfg.finetune_batch > len(order) and pos > 0:
                rng.shuffle(order)
                pos = 0
            rows = order[pos: pos + cfg.finetune_batch]
            pos += len(rows)
            slots, G = fwd.all_gates(rows)  # every slot open anywhere in the batch, not only the batch's own
            loss = fwd.nll(rows, G @ U[slots]).mean()
            if not torch.isfinite(loss):
                raise FloatingPointError("stage 8 (write fine-tuning): loss became NaN/Inf")
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(nll=f"{losses[-1]:.3f}", missed=len(order))
    return U.detach().float().cpu().clone(), losses


def produced_rows(fwd: EditedForward, U: torch.Tensor, rows: Sequence[int], batch: int) -> list[bool]:
    """For each of ``rows``: is every token of its target the argmax under the whole operator with
    writes ``U`` (teacher-forced, so the same as greedy decoding reproducing the target)?"""
    out: list[bool] = []
    U = U.to(fwd.device, torch.float32)
    with torch.no_grad():
        for start in range(0, len(rows), batch):
            part = list(rows[start: start + batch])
            slots, G = fwd.all_gates(part)
            out += fwd.scored(part, G @ U[slots])[1].tolist()
    return out
