"""Stage 6: write targets.

For each edit, the down-projection output change that makes the model produce the
target, optimised on its own for a few steps. The change is applied through the edit's own
calibrated gate at every position of prompt + target, i.e. in exactly the form the operator can
express (a rank-one change along the gate), so the "compress to rank 16, evaluate on the anchor"
step of the paper reduces to reading the vector off.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .. import distributed
from ..checkpoints import PartStore
from ..config import BuildConfig
from ..edited_forward import EditedForward


def write_targets(
    fwd: EditedForward,
    cfg: BuildConfig,
    parts: PartStore | None = None,
    rows_of: Sequence[Sequence[int]] | None = None,
    stats: dict | None = None,
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
    # the slots whose sequences this process ran: all in one process, a rank's share in a distributed
    # build (whose batches it saves under its own name)
    here = [i for i in range(n) if fwd.holds(rows_of[i])]
    batches = target_batches(fwd, rows_of, cfg.target_batch, here)
    label = distributed.own_name("batch")
    saved = {k for k in range(len(batches)) if parts is not None and parts.has(f"{label}-{k}")}
    steps: list[int] = []
    # the bar starts past the batches read back: its rate and time left are this run's
    bar = tqdm(total=len(batches), initial=len(saved), desc="stage 6: write targets", leave=False)
    with fwd.frozen(), bar:
        for k, slots in enumerate(batches):
            piece = parts.get(f"{label}-{k}") if k in saved else None
            if piece is not None and not torch.equal(piece.get("slots", torch.empty(0)), torch.tensor(slots)):
                piece = None  # saved by a run that formed its batches otherwise
            if piece is None:
                piece = _target_batch(fwd, [rows_of[i] for i in slots], cfg)
                piece["slots"] = torch.tensor(slots)
                if parts is not None:
                    parts.put(f"{label}-{k}", piece)
                bar.update(1)
            deltas[slots] = piece["delta"]
            if "steps" in piece:  # batches saved before the count was kept have none
                steps.append(int(piece["steps"]))
            for i, v, e in zip(slots, piece["nll"].tolist(), piece["produced"].tolist()):
                final_losses[i], produced[i] = v, bool(e)
            bar.set_postfix(nll=f"{float(piece['nll'].mean()):.3f}")
    if distributed.active():  # each slot was fitted on one rank, its entries zero on the others
        deltas = distributed.summed(deltas)
        final_losses = distributed.summed(torch.tensor(final_losses, dtype=torch.float64)).tolist()
        produced = distributed.summed(torch.tensor(produced, dtype=torch.int64)).bool().tolist()
        steps = [k for ks in distributed.gathered(steps) for k in ks]
    if stats is not None:
        stats["unproduced_slots"] = [i for i, made in enumerate(produced) if not made]
        if steps:
            stats.update(
                steps_mean=sum(steps) / len(steps),
                steps_max=max(steps),
                batches_past_target_steps=sum(k > cfg.target_steps for k in steps),
            )
    return deltas, final_losses, sum(produced) / max(n, 1)


def target_batches(
    fwd: EditedForward, rows_of: Sequence[Sequence[int]], size: int, slots: Sequence[int] | None = None
) -> list[list[int]]:
    """Stage 6's batches of slots. A step pads every sequence of a batch to the longest run of
    positions after a cached prefix (``EditedForward.upper_positions``), so slots are ordered by
    theirs: ordered by whole length, one sequence whose gates open early widens its batch, and
    the more slots an operator has, the more batches hold one. Each slot's delta has its own loss
    and its own Adam moments, so the grouping does not change what is fitted."""

    def cost(i: int) -> tuple[int, int]:
        return (max(fwd.upper_positions(r) for r in rows_of[i]), max(len(fwd.seqs[r]) for r in rows_of[i]))

    order = sorted(range(len(rows_of)) if slots is None else slots, key=cost)
    return [order[start : start + size] for start in range(0, len(order), size)]


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
