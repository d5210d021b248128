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

import contextlib
import random
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from aloe_kernels import AloeOperator, apply_aloe, remove_aloe
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.reference import gates_from_scores

from .config import BuildConfig
from .states import batch_inputs, model_device, normalize_rows, pad_id


def _autocast(model, cfg: BuildConfig):
    if cfg.compute_dtype == "bfloat16":
        return torch.autocast(model_device(model).type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def target_nll(logits: torch.Tensor, seqs: Sequence[Sequence[int]], target_lens: Sequence[int]) -> torch.Tensor:
    """Mean NLL per sequence of its last ``target_lens[b]`` tokens; ``logits`` holds the
    last K positions of left-padded rows (K >= max target length + 1 not needed: K = max len)."""
    K = logits.shape[1]
    losses = []
    for b, (seq, n) in enumerate(zip(seqs, target_lens)):
        tgt = torch.tensor(seq[-n:], device=logits.device)
        # logits at position p predict token p+1; the last n tokens are predicted by the n positions before them
        pred = logits[b, K - n - 1: K - 1]
        losses.append(F.cross_entropy(pred.float(), tgt))
    return torch.stack(losses)


def _forward_logits(model, seqs, pid, keep: int):
    """Logits of the last ``keep`` positions only. The output projection is applied to a
    contiguous slice of the final hidden states: slicing inside the model (logits_to_keep)
    hands a strided tensor to the vocabulary GEMM, which runs an order of magnitude slower on CPU."""
    inputs = batch_inputs(seqs, pid, model_device(model))
    hidden = model.base_model(**inputs, use_cache=False).last_hidden_state
    return model.get_output_embeddings()(hidden[:, -keep:].contiguous())


def _batch_nll(model, batch, lens, pid, cfg: BuildConfig) -> torch.Tensor:
    """Per-sequence target NLL of a batch of prompt + target sequences."""
    with _autocast(model, cfg):
        logits = _forward_logits(model, batch, pid, max(lens) + 1)
    return target_nll(logits, batch, lens)


def write_targets(
    model,
    tokenizer,
    seqs: Sequence[Sequence[int]],
    target_lens: Sequence[int],
    op: AloeOperator,
    cfg: BuildConfig,
) -> tuple[torch.Tensor, list[float]]:
    """Stage 6: for slot i, delta_i (d_out) minimising the target NLL with out += g_i(h) delta_i."""
    site = locate_down_proj(model, op.layer)
    device = model_device(model)
    pid = pad_id(tokenizer)
    n = len(seqs)
    deltas = torch.zeros(n, op.d_out)
    final_losses: list[float] = []
    V = op.addresses.to(device, torch.float32)
    tau = op.thresholds.to(device, torch.float32)
    alpha = op.temperatures.to(device, torch.float32)
    current: dict = {}

    def hook(module, args, out):
        rows = current["rows"]
        h = normalize_rows(args[0], op.eps)  # (B, T, d)
        s = torch.einsum("btd,bd->bt", h, V[rows])
        g = gates_from_scores(s, tau[rows, None], alpha[rows, None], op.gate_eps)
        return out + (g[..., None] * current["delta"][:, None, :]).to(out.dtype)

    handle = site.module.register_forward_hook(hook)
    try:
        bar = tqdm(range(0, n, cfg.target_batch), desc="stage 6: write targets", leave=False)
        for start in bar:
            rows = torch.arange(start, min(n, start + cfg.target_batch))
            batch = [seqs[i] for i in rows]
            lens = [target_lens[i] for i in rows]
            delta = torch.zeros(len(rows), op.d_out, device=device, requires_grad=True)
            opt = torch.optim.Adam([delta], lr=cfg.target_lr)
            current.update(rows=rows.to(device), delta=delta)
            for _ in range(cfg.target_steps):
                nll = _batch_nll(model, batch, lens, pid, cfg)
                loss = nll.sum() + 1e-3 * (delta**2).sum()
                if not torch.isfinite(loss):
                    raise FloatingPointError("stage 6 (write targets): loss became NaN/Inf")
                opt.zero_grad()
                loss.backward()
                opt.step()
            deltas[rows] = delta.detach().float().cpu()
            final_losses += nll.detach().float().cpu().tolist()
            bar.set_postfix(nll=f"{float(nll.mean()):.3f}")
    finally:
        handle.remove()
    return deltas, final_losses


def gates_of(states: torch.Tensor, op: AloeOperator, chunk: int = 8192) -> torch.Tensor:
    """Gates (N, n) of normalized states, in float32."""
    V, tau, alpha = (t.float() for t in (op.addresses, op.thresholds, op.temperatures))
    out = []
    for start in range(0, states.shape[0], chunk):
        s = states[start: start + chunk].float() @ V.T
        out.append(gates_from_scores(s, tau, alpha, op.gate_eps))
    return torch.cat(out) if out else torch.zeros(0, op.n)


def ridge_writes(
    deltas: torch.Tensor,
    anchors: torch.Tensor,
    anchor_owner: torch.Tensor,
    negatives: torch.Tensor,
    op: AloeOperator,
    cfg: BuildConfig,
) -> torch.Tensor:
    """Stage 7 (paper Eq. 6): U0 = Y G+^T (G+ G+^T + lambda G- G-^T + mu I)^-1, edit-major.

    Column a of Y is what anchor a should receive: its own slot's gate times that slot's target.
    """
    Gp = gates_of(anchors, op).double()  # (A, n)
    Y = Gp[torch.arange(len(anchor_owner)), anchor_owner][:, None] * deltas.double()[anchor_owner]  # (A, d_out)
    A = Gp.T @ Gp + cfg.ridge_mu * torch.eye(op.n, dtype=torch.float64)
    for start in range(0, negatives.shape[0], 16384):
        Gn = gates_of(negatives[start: start + 16384], op).double()
        A += cfg.ridge_lambda * (Gn.T @ Gn)
    writes = torch.linalg.solve(A, Gp.T @ Y)  # (n, d_out)
    if not torch.isfinite(writes).all():
        raise FloatingPointError("stage 7 (ridge solve): writes became NaN/Inf")
    return writes.float()


def finetune_writes(
    model,
    tokenizer,
    seqs: Sequence[Sequence[int]],
    target_lens: Sequence[int],
    op: AloeOperator,
    cfg: BuildConfig,
) -> tuple[torch.Tensor, list[float]]:
    """Stage 8: AdamW on U for target NLL over minibatches of edits, the whole operator in place."""
    if cfg.finetune_steps <= 0:
        return op.writes.clone(), []
    pid = pad_id(tokenizer)
    wrapper = apply_aloe(model, op, check_fingerprint=False)
    rng = random.Random(cfg.seed)
    losses: list[float] = []
    try:
        writes = wrapper.writes
        writes.requires_grad_(True)
        opt = torch.optim.AdamW([writes], lr=cfg.finetune_lr, weight_decay=0.0)
        order = list(range(len(seqs)))
        rng.shuffle(order)
        pos = 0
        bar = tqdm(range(cfg.finetune_steps), desc="stage 8: write fine-tuning", leave=False)
        for _ in bar:
            if pos + cfg.finetune_batch > len(order):
                rng.shuffle(order)
                pos = 0
            rows = order[pos: pos + cfg.finetune_batch]
            pos += len(rows)
            batch = [seqs[i] for i in rows]
            lens = [target_lens[i] for i in rows]
            loss = _batch_nll(model, batch, lens, pid, cfg).mean()
            if not torch.isfinite(loss):
                raise FloatingPointError("stage 8 (write fine-tuning): loss became NaN/Inf")
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            bar.set_postfix(nll=f"{losses[-1]:.3f}")
        return writes.detach().float().cpu().clone(), losses
    finally:
        remove_aloe(model)
