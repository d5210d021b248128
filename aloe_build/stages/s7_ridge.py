"""Stage 7 (paper Eq. 6): one ridge solve for all writes, accounting for edits whose
gates overlap and keeping writes small where negatives open a gate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from aloe_kernels import AloeOperator
from aloe_kernels.reference import gates_from_scores

from .. import distributed
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

    def merge(self, other: NegativeGateTally) -> None:
        """Add ``other``'s counts to this tally."""
        self.rows, self.any_open = self.rows + other.rows, self.any_open + other.any_open
        self.max_gate = max(self.max_gate, other.max_gate)

    def summed(self) -> NegativeGateTally:
        """The tally over every rank's blocks (itself in one process)."""
        if not distributed.active():
            return self
        rows, any_open = distributed.summed(torch.tensor([self.rows, self.any_open], dtype=torch.int64)).tolist()
        return NegativeGateTally(rows, any_open, max(distributed.gathered(self.max_gate)))

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
    In a distributed build each rank gates its share of the blocks of states and the sums are
    gathered, so every rank solves the same system (summed in another order than one process).
    """
    A = SparseGram(op.n, cfg.ridge_mu)
    rhs = torch.zeros(op.n, deltas.shape[1], dtype=torch.float64)  # G+^T Y
    targets = deltas.double()
    lo = 0
    taken = distributed.takes if distributed.active() else None
    for Gp in open_gates(anchors, op, taken=taken):
        owner = anchor_owner[lo : lo + Gp.n_rows]
        lo += Gp.n_rows
        Y = Gp.at(owner).double()[:, None] * targets[owner]  # (piece, d_out)
        S = Gp.sparse(op.n)
        A.add_(S)
        rhs += torch.sparse.mm(S.t(), Y)
    mine = NegativeGateTally()
    for block, Gn in enumerate(open_gates(negatives, op, taken=taken)):
        if taken is None or taken(block):  # another rank counts the rest
            mine.add(Gn)
        A.add_(Gn.sparse(op.n), cfg.ridge_lambda)
    if tally is not None:
        tally.merge(mine.summed())
    if distributed.active():
        entries = distributed.gathered(A.entries())
        A = SparseGram(op.n, cfg.ridge_mu)
        for indices, values in entries:  # in rank order: the same sum on every rank
            A.add_entries_(indices, values)
        rhs = distributed.summed(rhs)
    writes = solve_spd(A.matrix(), rhs)  # (n, d_out)
    if not torch.isfinite(writes).all():
        raise FloatingPointError("stage 7 (ridge solve): writes became NaN/Inf")
    return writes.float()
