"""The open gates of many states, kept as (row, slot, gate) triplets instead of a dense N x n matrix.

Gates are exactly 0 below each slot's open floor, and at thousands of edits almost every
(state, slot) pair is below it. Stage 7 needs the Gram matrix and the anchor products of the
gates of over a million states: dense, one block of them takes gigabytes in float64 and most of
the stage's time goes to gating, converting and multiplying zeros. Here only the scores are dense
(one block at a time); the gate formula runs on the entries above the floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from aloe_kernels import AloeOperator
from aloe_kernels.reference import gates_from_scores, open_score_floor

from .sparse_warnings import quiet_sparse

# Entries this far below the open floor are gated too, so that rounding between the floor and the
# gate formula can never drop a gate that the formula opens; the formula's own zeros are dropped after.
_FLOOR_SLACK = 1e-3
#: float32 scores per block: 4,292 states at 7,819 slots
BLOCK_BYTES = 128 * 2**20
#: the fewest states gated in one block
BLOCK_ROWS_MIN = 1024


@dataclass
class OpenGates:
    """The non-zero gates of a block of ``n_rows`` states: ``rows`` (local to the block), ``slots``
    and ``values`` (float32), in row-major order."""

    n_rows: int
    rows: torch.Tensor
    slots: torch.Tensor
    values: torch.Tensor

    def sparse(self, n: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The block as a coalesced sparse COO matrix (n_rows, n)."""
        index = torch.stack([self.rows, self.slots])
        with quiet_sparse():
            return torch.sparse_coo_tensor(
                index, self.values.to(dtype), (self.n_rows, n), is_coalesced=True, check_invariants=False
            )

    def at(self, slot_of_row: torch.Tensor) -> torch.Tensor:
        """Each row's gate at one slot of its own (``slot_of_row`` (n_rows,)): 0 where that gate is shut."""
        out = torch.zeros(self.n_rows, dtype=self.values.dtype, device=self.values.device)
        own = self.slots == slot_of_row[self.rows]
        out[self.rows[own]] = self.values[own]
        return out


def open_gates(
    parts: torch.Tensor | Sequence[torch.Tensor],
    op: AloeOperator,
    chunk: int | None = None,
    taken: Callable[[int], bool] | None = None,
) -> Iterator[OpenGates]:
    """The open gates of normalized states (one tensor, or several read in place), ``chunk`` rows at
    a time (default: blocks of about :data:`BLOCK_BYTES` of scores). Each value equals the dense
    formula's (:func:`aloe_kernels.reference.gates_from_scores` on the same float32 scores).

    With ``taken`` only the blocks whose index (counted over all parts) it accepts are gated; every
    other block comes as its row count with no gate (a distributed build's other ranks gate it)."""
    chunk = chunk or max(BLOCK_ROWS_MIN, BLOCK_BYTES // (4 * max(op.n, 1)))
    V, tau, alpha = (t.float() for t in (op.addresses, op.thresholds, op.temperatures))
    floor = open_score_floor(tau, alpha, op.gate_eps) - _FLOOR_SLACK
    index = -1
    for part in [parts] if isinstance(parts, torch.Tensor) else parts:
        for start in range(0, part.shape[0], chunk):
            block, index = part[start : start + chunk], index + 1
            if taken is not None and not taken(index):
                none = torch.zeros(0, dtype=torch.long, device=block.device)
                yield OpenGates(block.shape[0], none, none, torch.zeros(0, device=block.device))
                continue
            scores = block.float() @ V.T
            rows, slots = (scores > floor).nonzero(as_tuple=True)
            values = gates_from_scores(scores[rows, slots], tau[slots], alpha[slots], op.gate_eps)
            keep = values > 0
            yield OpenGates(block.shape[0], rows[keep], slots[keep], values[keep])
