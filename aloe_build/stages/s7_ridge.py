"""Stage 7 (paper Eq. 6): one ridge solve for all writes, accounting for edits whose
gates overlap and keeping writes small where negatives open a gate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from aloe_kernels import AloeOperator
from aloe_kernels.reference import gates_from_scores

from ..config import BuildConfig
from ..open_gates import OpenGates, open_gates
from ..sparse_solve import SparseGram, solve_spd


def gates_of(states: torch.Tensor, op: AloeOperator, chunk: int = 8192) -> torch.Tensor:
    """Gates (N, n) of normalized states, in float32."""
    V, tau, alpha = (t.float() for t in (op.addresses, op.thresholds, op.temperatures))
    out = []
    for start in range(0, states.shape[0], chunk):
        s = states[start : start + chunk].float() @ V.T
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
        return {"negative_any_open_share": self.any_open / self.rows if self.rows else 0.0, "negative_max_gate": self.max_gate}


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
    (:mod:`.open_gates`): the products cost what the open gates do, not N times n, and the system
    stays sparse, solved one group of slots that open together at a time (:mod:`..sparse_solve`).
    """
    A = SparseGram(op.n, cfg.ridge_mu)
    rhs = torch.zeros(op.n, deltas.shape[1], dtype=torch.float64)  # G+^T Y
    targets = deltas.double()
    lo = 0
    for Gp in open_gates(anchors, op):
        owner = anchor_owner[lo : lo + Gp.n_rows]
        lo += Gp.n_rows
        Y = Gp.at(owner).double()[:, None] * targets[owner]  # (piece, d_out)
        S = Gp.sparse(op.n)
        A.add_(S)
        rhs += torch.sparse.mm(S.t(), Y)
    for Gn in open_gates(negatives, op):
        if tally is not None:
            tally.add(Gn)
        A.add_(Gn.sparse(op.n), cfg.ridge_lambda)
    writes = solve_spd(A.matrix(), rhs)  # (n, d_out)
    if not torch.isfinite(writes).all():
        raise FloatingPointError("stage 7 (ridge solve): writes became NaN/Inf")
    return writes.float()
