"""Stage 8: a few AdamW steps of target NLL on the writes U with V, tau, alpha frozen, on
minibatches of edits with the whole operator in place.
"""

from __future__ import annotations

import math
import random
from typing import Sequence

import torch
from tqdm.auto import tqdm

from .. import distributed
from ..config import BuildConfig
from ..edited_forward import EditedForward


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
                order = [i for i, ok in zip(everything, produced_rows(fwd, U.detach(), everything, cfg.finetune_batch)) if not ok]
                if not order:
                    break  # every target is produced
                rng.shuffle(order)
                pos = 0
            if pos + cfg.finetune_batch > len(order) and pos > 0:
                rng.shuffle(order)
                pos = 0
            rows = order[pos : pos + cfg.finetune_batch]
            pos += len(rows)
            losses.append(_batch_step(fwd, U, opt, rows))
            bar.set_postfix(nll=f"{losses[-1]:.3f}", missed=len(order))
    return U.detach().float().cpu().clone(), losses


def _batch_step(fwd: EditedForward, U: torch.Tensor, opt: torch.optim.Optimizer, rows: list[int]) -> float:
    """One AdamW step on the mean target NLL of ``rows``; returns that mean. In a distributed
    build each rank takes the batch's sequences it holds and the gradients are summed, which is
    the one-process gradient of the whole batch."""
    here = fwd.held_of(rows)
    opt.zero_grad()
    total = torch.zeros((), device=U.device)
    if here:
        slots, G = fwd.all_gates(here)  # every slot open anywhere in the batch, not only the batch's own
        total = fwd.nll(here, G @ U[slots]).sum()
        (total / len(rows)).backward()
    if distributed.active():
        U.grad = distributed.summed(U.grad if U.grad is not None else torch.zeros_like(U))
        total = distributed.summed(total.detach())
    loss = float(total.detach()) / len(rows)
    if not math.isfinite(loss):
        raise FloatingPointError("stage 8 (write fine-tuning): loss became NaN/Inf")
    opt.step()
    return loss


def produced_rows(fwd: EditedForward, U: torch.Tensor, rows: Sequence[int], batch: int) -> list[bool]:
    """For each of ``rows``: is every token of its target the argmax under the whole operator with
    writes ``U`` (teacher-forced, so the same as greedy decoding reproducing the target)? In a
    distributed build each rank scores the rows it holds and every rank gets all the answers."""
    rows = list(rows)
    here = fwd.held_of(rows)
    made: dict[int, bool] = {}
    U = U.to(fwd.device, torch.float32)
    with torch.no_grad():
        for start in range(0, len(here), batch):
            part = here[start : start + batch]
            slots, G = fwd.all_gates(part)
            made.update(zip(part, fwd.scored(part, G @ U[slots])[1].tolist()))
    if not distributed.active():
        return [made[i] for i in rows]
    flags = torch.tensor([int(made.get(i, False)) for i in rows], dtype=torch.int64)
    return distributed.summed(flags).bool().tolist()
