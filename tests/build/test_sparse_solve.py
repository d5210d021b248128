"""The block-by-block sparse SPD solve of stage 7 against a dense float64 solve."""

from __future__ import annotations

import pytest
import torch

from aloe_build.sparse_solve import SparseGram, components, conjugate_gradients, solve_spd


def _gates(rows: int, n: int, per_row: int, gen: torch.Generator, slots: int | None = None) -> torch.Tensor:
    """A sparse (rows, n) block whose rows open ``per_row`` random gates among the first ``slots``."""
    slots = n if slots is None else slots
    r = torch.arange(rows).repeat_interleave(per_row)
    c = torch.randint(0, slots, (rows * per_row,), generator=gen)
    v = torch.rand(rows * per_row, generator=gen, dtype=torch.float64)
    return torch.sparse_coo_tensor(torch.stack([r, c]), v, (rows, n)).coalesce()


def _by_search(n: int, pairs: list[tuple[int, int]]) -> list[int]:
    """Each node's smallest reachable node, by depth-first search."""
    nbr: dict[int, set[int]] = {k: set() for k in range(n)}
    for a, b in pairs:
        nbr[a].add(b)
        nbr[b].add(a)
    out = [-1] * n
    for s in range(n):
        if out[s] >= 0:
            continue
        stack, seen = [s], {s}
        while stack:
            for m in nbr[stack.pop()] - seen:
                seen.add(m)
                stack.append(m)
        for m in seen:
            out[m] = min(seen)
    return out


@pytest.mark.parametrize("n, edges", [(1, 0), (7, 0), (13, 4), (50, 30), (97, 200)])
def test_components_match_a_graph_search(n, edges):
    gen = torch.Generator().manual_seed(n + edges)
    i = torch.randint(0, n, (edges,), generator=gen)
    j = torch.randint(0, n, (edges,), generator=gen)
    got = components(n, i, j).tolist()
    assert got == _by_search(n, list(zip(i.tolist(), j.tolist())))


def test_a_chain_is_one_component_whatever_its_order():
    n = 40
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(0))
    assert components(n, perm[:-1], perm[1:]).tolist() == [0] * n


@pytest.mark.parametrize("dense_limit", [4096, 3, 1])
@pytest.mark.parametrize("n, rows, per_row, k", [(1, 3, 1, 1), (37, 60, 2, 5), (101, 300, 1, 3), (64, 40, 3, 1), (20, 0, 1, 2)])
def test_solve_matches_a_dense_solve(dense_limit, n, rows, per_row, k):
    """Random gates (singletons, pairs, larger groups, no rows at all), ``mu`` small: the dense
    route, the CG route (``dense_limit`` below the groups' sizes) and their mix agree with float64
    ``torch.linalg.solve`` of the dense matrix, built here independently from the blocks."""
    gen = torch.Generator().manual_seed(n * 1000 + rows + per_row + dense_limit)
    mu, lam = 1e-3, 0.7
    gram = SparseGram(n, mu)
    dense = mu * torch.eye(n, dtype=torch.float64)
    for weight, block in [(1.0, _gates(rows, n, per_row, gen)), (lam, _gates(rows // 2, n, per_row, gen, slots=max(1, n // 2)))]:
        gram.add_(block, weight)
        d = block.to_dense()
        dense += weight * d.T @ d
    A = gram.matrix()
    torch.testing.assert_close(A.to_dense(), dense, rtol=1e-12, atol=1e-14)
    b = torch.randn(n, k, generator=gen, dtype=torch.float64)
    want = torch.linalg.solve(dense, b)
    got = solve_spd(A, b, dense_limit=dense_limit)
    torch.testing.assert_close(got, want, rtol=1e-7, atol=1e-9)


def test_conjugate_gradients_report_failure_to_converge():
    gen = torch.Generator().manual_seed(3)
    M = torch.randn(30, 30, generator=gen, dtype=torch.float64)
    A = (M @ M.T + 1e-6 * torch.eye(30, dtype=torch.float64)).to_sparse().coalesce()
    b = torch.randn(30, 2, generator=gen, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="conjugate gradients"):
        conjugate_gradients(A, b, max_iter=2)
    torch.testing.assert_close(conjugate_gradients(A, b, tol=1e-13), torch.linalg.solve(A.to_dense(), b), rtol=1e-5, atol=1e-6)
