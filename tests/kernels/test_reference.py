"""The reference math against an independent float64 computation."""

import math

import pytest
import torch
from helpers import random_operator

from aloe_kernels import AloeOperator, aloe_gates, aloe_reference, aloe_residual_


def independent_delta(h: torch.Tensor, op: AloeOperator) -> torch.Tensor:
    """Row by row, edit by edit, in Python floats (float64)."""
    out = torch.zeros(h.shape[0], op.d_out, dtype=torch.float64)
    V, tau, alpha, U = (t.double() for t in (op.addresses, op.thresholds, op.temperatures, op.writes))
    for t in range(h.shape[0]):
        row = h[t].double()
        hbar = row / max(math.sqrt(float((row * row).sum())), op.eps)
        for i in range(op.n):
            s = float((V[i] * hbar).sum())
            sig = 1.0 / (1.0 + math.exp(-float(alpha[i]) * (s - float(tau[i]))))
            g = max(sig - op.gate_eps, 0.0) / (1.0 - op.gate_eps)
            out[t] += g * U[i]
    return out


@pytest.mark.parametrize("n,d,d_out,T", [(1, 7, 5, 1), (13, 37, 11, 9), (40, 64, 24, 33)])
def test_reference_matches_independent_float64(n, d, d_out, T):
    op = random_operator(n, d, d_out, dtype=torch.float64, seed=n)
    h = torch.randn(T, d, dtype=torch.float64)
    h[0] = torch.nn.functional.normalize(op.addresses[0], dim=0) * 3  # make sure one gate opens
    torch.testing.assert_close(aloe_reference(h, op), independent_delta(h, op), rtol=1e-12, atol=1e-12)


def test_gates_dead_zone_and_range():
    op = random_operator(50, 32, 8, dtype=torch.float64)
    h = torch.randn(400, 32, dtype=torch.float64)
    g = aloe_gates(h, op)
    hbar = torch.nn.functional.normalize(h, dim=1)
    z = op.temperatures * (hbar @ op.addresses.T - op.thresholds)
    below = torch.sigmoid(z) <= op.gate_eps
    assert below.any() and (~below).any()
    assert (g[below] == 0).all()
    assert ((g[~below] > 0) & (g[~below] <= 1)).all()


def test_leading_dims_and_dtype_kept():
    op = random_operator(6, 16, 8)
    h = torch.randn(2, 3, 16, dtype=torch.bfloat16)
    out = aloe_reference(h, op)
    assert out.shape == (2, 3, 8) and out.dtype == torch.bfloat16
    assert aloe_gates(h, op).shape == (2, 3, 6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_zero_rows_stay_finite(dtype):
    op = random_operator(5, 16, 8, dtype=dtype)
    h = torch.zeros(4, 16, dtype=dtype)
    g = aloe_gates(h, op)
    expected = torch.clamp_min(torch.sigmoid(-op.temperatures.double() * op.thresholds.double()) - op.gate_eps, 0) / (
        1 - op.gate_eps
    )
    torch.testing.assert_close(g[0].double(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)
    assert torch.isfinite(aloe_reference(h, op)).all()


def test_finite_input_never_non_finite_output():
    op = random_operator(8, 16, 8)
    h = torch.randn(16, 16) * torch.logspace(-30, 30, 16).unsqueeze(1)
    assert torch.isfinite(aloe_reference(h, op)).all()
    y = torch.zeros(16, 8)
    assert torch.isfinite(aloe_residual_(y, h, op)).all()


def test_wrong_width_raises():
    op = random_operator(3, 16, 8)
    with pytest.raises(ValueError, match="d=16"):
        aloe_reference(torch.randn(2, 15), op)
