"""The CPU sparse path ``sparse_residual_`` (every branch) against a float64 evaluation."""

import math

import pytest
import torch

from aloe_kernels import AloeOperator
from aloe_kernels.residual import sparse_residual_


def _case(T, d, d_out, n, open_frac, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, d, generator=g, dtype=torch.float64)
    A = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    temps = 10 + 20 * torch.rand(n, generator=g, dtype=torch.float64)
    thr = torch.full((n,), 5.0, dtype=torch.float64)
    k = int(round(open_frac * n))
    thr[:k] = -0.2 + 0.3 * torch.rand(k, generator=g, dtype=torch.float64)  # some tokens open these
    op = AloeOperator(
        addresses=A, thresholds=thr, temperatures=temps, writes=torch.randn(n, d_out, generator=g, dtype=torch.float64)
    )
    return h.to(dtype), op.to(dtype=dtype)


def _ref(h, op):
    hd = h.double()
    s = (hd / hd.norm(dim=-1, keepdim=True).clamp_min(op.eps)) @ op.addresses.double().T
    gate = torch.clamp_min(torch.sigmoid(op.temperatures.double() * (s - op.thresholds.double())) - op.gate_eps, 0)
    return gate / (1 - op.gate_eps) @ op.writes.double()


def _rel(a, b):
    return float((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize(
    "T,d,n,open_frac",
    [
        (16, 48, 1000, 0.01),  # gather branch, d <= n (inputs normalised)
        (16, 48, 100, 0.9),  # dense branch (most edits open)
        (1, 48, 100, 0.05),  # single token
        (5, 200, 7, 0.3),  # d > n (scores scaled instead of inputs)
        (7, 48, 50, 0.0),  # nothing open: y untouched
    ],
)
def test_sparse_branches(T, d, n, open_frac):
    h, op = _case(T, d, 24, n, open_frac, seed=T + n)
    y = torch.randn(T, 24)
    before = y.clone()
    sparse_residual_(y, h, op)
    ref = _ref(h, op)
    if open_frac == 0.0:
        assert torch.equal(y, before)
    else:
        assert _rel(y - before, ref) <= 1e-4


def test_sparse_float64_bfloat16_and_batched_views():
    h, op = _case(6, 48, 24, 200, 0.2, seed=3, dtype=torch.float64)
    ref = _ref(h, op)
    y = torch.zeros(6, 24, dtype=torch.float64)
    sparse_residual_(y, h, op)
    assert _rel(y, ref) <= 1e-12
    hb, opb = h.to(torch.bfloat16), op.to(dtype=torch.bfloat16)
    yb = torch.zeros(6, 24, dtype=torch.bfloat16)
    sparse_residual_(yb, hb, opb)
    assert _rel(yb, _ref(hb, opb)) <= 2e-2
    # (2, 3, d) input, y a non-contiguous view (column slice of a wider buffer)
    h3 = h.float().reshape(2, 3, 48)
    big = torch.zeros(2, 3, 30)
    sparse_residual_(big[..., :24], h3, op.to(dtype=torch.float32))
    assert _rel(big[..., :24].reshape(6, 24), ref) <= 1e-4
    assert bool((big[..., 24:] == 0).all())


def test_sparse_gate_eps_zero_opens_everything():
    h, op = _case(4, 48, 24, 30, 0.0, seed=5)
    op.gate_eps = 0.0
    y = torch.zeros(4, 24)
    sparse_residual_(y, h, op)
    assert _rel(y, _ref(h, op)) <= 1e-4 and math.isfinite(float(y.abs().sum()))
