"""int8 addresses (per-128-column float16 scales) and their screen: skipped pairs are provably closed.

Checked against float64: the dequantisation error norm bounds the score error for every state,
including a state along an edit's quantisation error (where Cauchy-Schwarz is tight); every pair
the screen skips has gate exactly 0 in the full-precision operator; the screened residual equals
the full path's.
"""

import math

import pytest
import torch

from aloe_kernels import AloeOperator
from aloe_kernels.int8_addresses import GROUP, Int8Addresses, int8_address_residual_
from aloe_kernels.reference import aloe_gates, aloe_reference, normalize_rows
from aloe_kernels.residual import sparse_residual_

GATE_EPS = 1e-3


def operator(n, d, d_out, seed, scale=100.0):
    """Addresses of norm ~``scale`` (as built ones are on SmolLM2), floors between the scores of random states."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, generator=g, dtype=torch.float64)
    a = a / a.norm(dim=1, keepdim=True) * scale * (0.5 + torch.rand(n, 1, generator=g, dtype=torch.float64))
    temps = 20.0 + 200.0 * torch.rand(n, generator=g, dtype=torch.float64)
    floor = scale * (0.05 + 0.1 * torch.rand(n, generator=g, dtype=torch.float64))
    thresholds = floor - math.log(GATE_EPS / (1 - GATE_EPS)) / temps
    writes = torch.randn(n, d_out, generator=g, dtype=torch.float64)
    return AloeOperator(
        addresses=a.float(), thresholds=thresholds.float(), temperatures=temps.float(), writes=writes.float(), gate_eps=GATE_EPS
    )


def states(op, T, seed, along=()):
    """Random states, some made to open chosen edits, and for each edit in ``along`` its quantisation error."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, op.d, generator=g)
    k = min(T, op.n) // 2  # the first k states lean towards the first k addresses
    unit_a = op.addresses[:k] / op.addresses[:k].norm(dim=1, keepdim=True)
    h[:k] += 0.3 * unit_a * h[:k].norm(dim=1, keepdim=True)
    rows = [h]
    q = Int8Addresses.quantize(op.addresses)
    for e in along:
        rows.append((op.addresses[e].double() - q.dequantized()[e].double()).float()[None, :] * 1e3)
    return torch.cat(rows)


@pytest.mark.parametrize("n,d", [(1, 5), (7, 128), (40, 300), (33, 1536)])
def test_format(n, d):
    op = operator(n, d, 4, seed=n + d)
    q = Int8Addresses.quantize(op.addresses)
    assert q.values.dtype == torch.int8 and q.values.shape == (n, d)
    assert q.scales.dtype == torch.float16 and q.scales.shape == (n, -(-d // GROUP))
    assert int(q.values.abs().max()) <= 127
    err = torch.linalg.vector_norm(op.addresses.double() - q.dequantized().double(), dim=1)
    assert bool((err <= q.error_norms.double()).all())
    assert bool((q.error_norms.double() <= err * (1 + 1e-6) + 1e-30).all())
    hat = torch.linalg.vector_norm(q.dequantized().double(), dim=1)
    assert bool((hat <= q.dequant_norms.double()).all())


def test_zero_group_and_bad_input():
    a = torch.zeros(2, 300)
    a[1, 200:] = torch.randn(100)
    q = Int8Addresses.quantize(a)
    assert torch.equal(q.dequantized()[0], torch.zeros(300)) and float(q.error_norms[0]) == 0.0
    with pytest.raises(ValueError, match="NaN"):
        Int8Addresses.quantize(torch.full((1, 4), float("nan")))
    with pytest.raises(ValueError, match=r"\(n, d\)"):
        Int8Addresses.quantize(torch.ones(4))


def test_bound_holds_and_is_tight_along_the_error():
    op = operator(50, 1536, 8, seed=3)
    q = Int8Addresses.quantize(op.addresses)
    along = (0, 17, 49)
    h = states(op, 64, seed=4, along=along)
    units = normalize_rows(h, op.eps)
    exact = units.double() @ op.addresses.double().T
    screen = units.double() @ q.dequantized().double().T
    assert bool((exact - screen <= q.error_norms.double()[None, :] * (1 + 1e-5)).all())
    # Every pair the limits skip is below its open floor in float64 (with room for the float32 product).
    floor = op.thresholds.double() + math.log(GATE_EPS / (1 - GATE_EPS)) / op.temperatures.double()
    limits = q.screen_limits(op.addresses, op.thresholds, op.temperatures, op.gate_eps).double()
    assert bool((limits < floor).all())
    for i, e in enumerate(along):  # the adversarial state: the true score exceeds the screen's by about r
        gap = float(exact[64 + i, e] - screen[64 + i, e])
        assert gap >= 0.999 * float(q.error_norms[e])


def test_skipped_pairs_are_closed_and_residual_matches():
    op = operator(300, 1536, 24, seed=5)
    q = Int8Addresses.quantize(op.addresses)
    h = states(op, 33, seed=6, along=(2,))
    # Put edit 2's open floor between its screen score and its exact score on the adversarial state:
    # only the error bound keeps it.
    units = normalize_rows(h, op.eps)
    exact = float(units[-1].double() @ op.addresses[2].double())
    screen = float(units[-1].double() @ q.dequantized()[2].double())
    assert exact - screen > 1e-3
    logit = math.log(GATE_EPS / (1 - GATE_EPS))
    op.thresholds[2] = float((exact + screen) / 2 - logit / float(op.temperatures[2]))
    kept = q.kept(units, op.addresses, op.thresholds, op.temperatures, op.gate_eps)
    gates = aloe_gates(h, op)
    opened = (gates > 0).any(dim=0).nonzero().squeeze(1)
    assert 2 in opened.tolist() and 2 in kept.tolist()
    skipped = torch.ones(op.n, dtype=torch.bool)
    skipped[kept] = False
    assert 0 < int(skipped.sum()) < op.n
    assert bool((gates[:, skipped] == 0).all()), "a skipped pair opens in the full-precision operator"
    assert bool((aloe_gates(h.double(), op)[:, skipped] == 0).all())
    y = torch.randn(h.shape[0], op.d_out)
    y_full = y.clone()
    int8_address_residual_(y, h, q, op)
    sparse_residual_(y_full, h, op)
    torch.testing.assert_close(y, y_full, rtol=1e-5, atol=1e-5)
    ref = aloe_reference(h.double(), op)
    assert float(((y - y_full).double().abs().max())) <= 1e-4 * float(ref.abs().max())


def test_mismatched_operator_is_refused():
    op = operator(5, 64, 4, seed=1)
    q = Int8Addresses.quantize(operator(6, 64, 4, seed=1).addresses)
    with pytest.raises(ValueError, match="6 x 64"):
        int8_address_residual_(torch.zeros(1, 4), torch.randn(1, 64), q, op)
