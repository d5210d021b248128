"""The screened CPU path (bf16 screen, exact fp32 gates for the edits that pass it) against float64.

Built addresses are not unit vectors: on SmolLM2 their norms are about 90-170 and some gates are steep
(temperatures up to ~160), so the bf16 error of a score grows with the norm and a margin sized for
unit addresses drops gates that open. These cases are built that way.
"""

import torch
from helpers import operator_near_its_floors

from aloe_kernels import aloe_reference
from aloe_kernels.reference import open_score_floor
from aloe_kernels.screened import SCREEN_MARGIN, screen_limit, screened_residual_


def _screened(h, op, limit):
    y = torch.zeros(h.shape[0], op.writes.shape[1])
    screened_residual_(
        y, h, op.addresses.to(torch.bfloat16), limit, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps
    )
    return y


def test_screen_keeps_every_open_gate_of_long_addresses():
    """Same result as float64, within what fp32 scores allow on gates this steep (a score of norm 170
    carries ~1e-5 of fp32 error, times a temperature of 160: the fp32 path itself is 1.6e-3 off)."""
    for seed in (0, 1, 2):
        h, op = operator_near_its_floors(seed)
        want64 = aloe_reference(h.double(), op.to(dtype=torch.float64))
        assert int((want64.abs().sum(1) > 0).sum()) > 20
        got = _screened(h, op, screen_limit(op.addresses, op.thresholds, op.temperatures, op.gate_eps))
        torch.testing.assert_close(got.double(), want64, atol=5e-3, rtol=5e-3)


def test_a_margin_blind_to_the_norm_drops_open_gates_here():
    """The case above is hard enough: the unit-address margin (floor - SCREEN_MARGIN) loses gates
    (rows off float64 by more than the 5e-3 that fp32 scores allow)."""
    lost = 0
    for seed in (0, 1, 2):
        h, op = operator_near_its_floors(seed)
        want = aloe_reference(h.double(), op.to(dtype=torch.float64)).float()
        unit = (open_score_floor(op.thresholds, op.temperatures, op.gate_eps) - SCREEN_MARGIN).to(torch.bfloat16)
        got = _screened(h, op, unit)
        lost += int(((got - want).abs().amax(dim=1) > 5e-3).sum())
    assert lost > 0


def test_screen_limit_scales_with_the_norm_and_the_floor():
    addresses = torch.tensor([[0.6, 0.8], [60.0, 80.0], [0.0, 0.0]])
    thresholds = torch.tensor([0.5, 50.0, -300.0])
    temperatures = torch.tensor([10.0, 10.0, 10.0])
    floor = open_score_floor(thresholds, temperatures, 1e-3)
    lim = screen_limit(addresses, thresholds, temperatures, 1e-3).float()
    margins = floor - lim
    # unit address: the plain margin; norm 100: 100 times it; zero address, floor -300.7: 300.7 times it
    # (each within the bf16 rounding of the limit)
    for m, scale, f in zip(margins.tolist(), (1.0, 100.0, float(floor[2].abs())), floor.abs().tolist()):
        assert abs(m - SCREEN_MARGIN * scale) <= 2**-8 * f + 1e-6
