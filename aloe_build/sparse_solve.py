"""A sparse symmetric positive definite system solved block by block: the ridge of stage 7 without an
n x n dense matrix.

The ridge matrix ``mu I + G+^T G+ + lambda G-^T G-`` couples two slots only where some state opens
both their gates, and at thousands of edits almost no pair ever opens together: the matrix is block
diagonal up to a permutation, one block per connected component of the "open together" graph. Each
block is solved on its own, exactly (a dense solve of its size); a single slot is a
division. Memory and time then follow the number of non-zero pairs, not n squared. A component too
large for a dense solve (``dense_limit`` slots) is solved by conjugate gradients on its sparse
matrix instead, preconditioned by its diagonal, to a stated relative residual.
"""

from __future__ import annotations

import torch

from .sparse_warnings import quiet_sparse

#: components up to this many slots are solved densely (a 4,096-slot block is 128 MiB in float64)
DENSE_LIMIT = 4096
#: relative residual |b - A x| / |b| at which conjugate gradients stop
CG_TOLERANCE = 1e-12


class SparseGram:
    """``mu I + sum_k w_k S_k^T S_k`` over blocks ``S_k`` (sparse COO (rows, n)), kept sparse."""

    def __init__(self, n: int, mu: float):
        self.n, self.mu = n, float(mu)
        with quiet_sparse():
            self._sum = torch.sparse_coo_tensor(torch.zeros(2, 0, dtype=torch.long), torch.zeros(0, dtype=torch.float64), (n, n))

    def add_(self, S: torch.Tensor, weight: float = 1.0) -> None:
        """Add ``weight * S^T S`` (through the open gates only)."""
        if S._nnz() == 0:
            return
        with quiet_sparse():
            gram = torch.sparse.mm(S.t(), S)
            self._sum = (self._sum + weight * gram).coalesce()

    def entries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The sum so far (without ``mu``) as coalesced (indices (2, nnz), values)."""
        s = self._sum.coalesce()
        return s.indices(), s.values()

    def add_entries_(self, indices: torch.Tensor, values: torch.Tensor) -> None:
        """Add a sum given as :meth:`entries` (another process's share of the blocks)."""
        with quiet_sparse():
            self._sum = (self._sum + torch.sparse_coo_tensor(indices, values, (self.n, self.n))).coalesce()

    def matrix(self) -> torch.Tensor:
        """The whole matrix as a coalesced sparse COO (n, n) float64 tensor, ``mu`` on the diagonal."""
        eye = torch.arange(self.n).expand(2, -1)
        with quiet_sparse():
            diag = torch.sparse_coo_tensor(eye, torch.full((self.n,), self.mu, dtype=torch.float64), (self.n, self.n))
            return (self._sum.coalesce() + diag).coalesce()


def _diagonal(A: torch.Tensor) -> torch.Tensor:
    """The diagonal of a coalesced sparse COO (k, k) matrix, float64 (zero where no entry is stored)."""
    (i, j), v = A.indices(), A.values()
    return torch.zeros(A.shape[0], dtype=torch.float64).index_add_(0, i[i == j], v[i == j].double())


def components(n: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """The connected component of each of ``n`` nodes under the edges ``(i, j)``: labels (n,), each
    the smallest node of its component (min-label propagation with pointer jumping)."""
    label = torch.arange(n)
    if i.numel() == 0:
        return label
    while True:
        prev = label
        low = torch.minimum(label[i], label[j])
        label = label.scatter_reduce(0, i, low, reduce="amin").scatter_reduce(0, j, low, reduce="amin")
        label = label[label]  # every node jumps to its label's label
        if torch.equal(label, prev):
            return label


def solve_spd(A: torch.Tensor, b: torch.Tensor, dense_limit: int = DENSE_LIMIT, tol: float = CG_TOLERANCE) -> torch.Tensor:
    """``A^-1 b`` for a sparse symmetric positive definite ``A`` (coalesced COO (n, n)) and dense
    ``b`` (n, k), component by component (module doc); float64."""
    A = A.coalesce()
    n = A.shape[0]
    (i, j), v = A.indices(), A.values()
    b = b.double()
    off = (i != j) & (v != 0)
    label = components(n, i[off], j[off])
    x = torch.empty_like(b)
    # members of each component, components ordered by label
    order = torch.argsort(label, stable=True)
    labels, sizes = torch.unique_consecutive(label[order], return_counts=True)
    diag = _diagonal(A)
    single = labels[sizes == 1]
    x[single] = b[single] / diag[single, None]
    # position of each node inside its component, for scattering the entries into blocks
    starts = torch.cumsum(sizes, 0) - sizes
    local = torch.empty(n, dtype=torch.long)
    local[order] = torch.arange(n) - torch.repeat_interleave(starts, sizes)
    comp_of = torch.empty(n, dtype=torch.long)
    comp_of[order] = torch.repeat_interleave(torch.arange(labels.numel()), sizes)
    entry_comp = comp_of[i]
    by_comp = torch.argsort(entry_comp, stable=True)
    entry_counts = torch.bincount(entry_comp, minlength=labels.numel())
    entry_starts = torch.cumsum(entry_counts, 0) - entry_counts
    for c in (sizes > 1).nonzero().squeeze(1).tolist():
        members = order[starts[c] : starts[c] + sizes[c]]
        e = by_comp[entry_starts[c] : entry_starts[c] + entry_counts[c]]
        k = int(sizes[c])
        if k <= dense_limit:
            block = torch.zeros(k, k, dtype=torch.float64)
            block.index_put_((local[i[e]], local[j[e]]), v[e], accumulate=True)
            x[members] = torch.linalg.solve(block, b[members])
        else:
            with quiet_sparse():
                block = torch.sparse_coo_tensor(torch.stack([local[i[e]], local[j[e]]]), v[e], (k, k)).coalesce()
            x[members] = conjugate_gradients(block, b[members], tol)
    return x


def conjugate_gradients(A: torch.Tensor, b: torch.Tensor, tol: float = CG_TOLERANCE, max_iter: int | None = None) -> torch.Tensor:
    """``A^-1 b`` for a sparse symmetric positive definite ``A`` (k, k) and ``b`` (k, m), every column
    at once, Jacobi-preconditioned, until each column's relative residual is below ``tol``;
    a RuntimeError if ``max_iter`` (default 10 k) steps do not get there."""
    k = A.shape[0]
    max_iter = max_iter or 10 * k
    inv_diag = 1.0 / _diagonal(A)
    x = torch.zeros_like(b)
    r = b.clone()
    z = inv_diag[:, None] * r
    p = z.clone()
    rz = (r * z).sum(0)
    target = tol * torch.linalg.vector_norm(b, dim=0).clamp_min(torch.finfo(torch.float64).tiny)
    for _ in range(max_iter):
        if (torch.linalg.vector_norm(r, dim=0) <= target).all():
            return x
        Ap = torch.sparse.mm(A, p)
        step = rz / (p * Ap).sum(0).clamp_min(torch.finfo(torch.float64).tiny)
        x += step * p
        r -= step * Ap
        z = inv_diag[:, None] * r
        rz_next = (r * z).sum(0)
        p = z + (rz_next / rz.clamp_min(torch.finfo(torch.float64).tiny)) * p
        rz = rz_next
    raise RuntimeError(f"conjugate gradients did not reach a relative residual of {tol} in {max_iter} steps")
