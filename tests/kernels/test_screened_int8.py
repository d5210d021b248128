"""The int8-screened CPU path (PyTorch's int8 linear, exact fp32 gates for the kept edits) against float64.

The screen must never drop an edit that opens: its bound is checked pair by pair against float64
scores, on served-like operators (long addresses, steep gates, outlier dimensions) and edge cases.
"""

import pytest
import torch
from helpers import operator_near_its_floors, random_operator

from aloe_kernels import AloeOperator, aloe_reference
from aloe_kernels.reference import normalize_rows
from aloe_kernels.screened_int8 import ADDRESS_LEVELS, INT8_SCREEN_MAX_TOKENS, STATE_LEVELS, Int8Screen, int8_screened_residual_


def _screen(op: AloeOperator) -> Int8Screen:
    return Int8Screen.prepare(op.addresses, op.thresholds, op.temperatures, op.gate_eps)


def _run(h: torch.Tensor, op: AloeOperator, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(y0, y0 + the path's residual): y starts random, so a path that overwrites y fails."""
    y0 = torch.randn(*h.shape[:-1], op.d_out, generator=torch.Generator().manual_seed(seed))
    y = y0.clone()
    int8_screened_residual_(y, h, _screen(op), op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps)
    return y0, y


def _check_against_float64(h: torch.Tensor, op: AloeOperator) -> None:
    """Within what fp32 scores allow on the steep gates of served operators (the fp32 path is 1.6e-3 off)."""
    y0, y = _run(h, op)
    want64 = aloe_reference(h.double(), op.to(dtype=torch.float64))
    torch.testing.assert_close((y - y0).double(), want64, atol=5e-3, rtol=5e-3)


def _outlier_states(T: int, d: int, seed: int) -> torch.Tensor:
    """Hidden states with a few large dimensions, as LLM activations have (a wide [min, max] per row)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, d, generator=g)
    h[:, torch.randperm(d, generator=g)[:3]] *= 40.0
    return h


@pytest.mark.parametrize("T", [1, 7, INT8_SCREEN_MAX_TOKENS])
def test_same_gates_as_fp32_on_long_steep_addresses(T):
    for seed in (0, 1, 2):
        h, op = operator_near_its_floors(seed, T=T)
        opened = int((aloe_reference(h.double(), op.to(dtype=torch.float64)).abs().sum(1) > 0).sum())
        assert opened > 0
        _check_against_float64(h, op)


def test_the_bound_holds_for_every_pair_and_is_not_vacuous():
    for seed, (T, d, n) in enumerate([(1, 97, 1), (33, 97, 257), (64, 256, 400), (5, 1536, 61)]):
        g = torch.Generator().manual_seed(seed)
        h = _outlier_states(T, d, seed)
        h[0] = 0.0  # a zero row
        if T > 2:
            h[1] = 3.0  # a constant row: min == max
        addresses = _outlier_states(n, d, seed + 100) * (20.0 + 150.0 * torch.rand(n, 1, generator=g))
        op = AloeOperator(addresses=addresses, thresholds=torch.zeros(n), temperatures=torch.ones(n), writes=torch.zeros(n, 3))
        hn = normalize_rows(h, op.eps)
        score, slack = _screen(op).bounds(hn)
        exact = normalize_rows(h.double(), op.eps).double() @ addresses.double().T
        assert bool(((exact - score.double()).abs() <= slack.double()).all())
        # a fraction of the largest possible score |h| |v| (Cauchy-Schwarz), even with outlier
        # dimensions in the addresses too (coarse int8 steps); about 0.045 on a built operator
        assert float((slack / addresses.norm(dim=1)).median()) < 0.2


def test_the_bound_is_tight_where_rounding_errors_align():
    """An input built so that every rounding error adds up: each entry of x = (h - min) / (max - min) just
    under half a level above a level (0.499 of one), each address entry 0.499 of a step off the grid with
    the sign of h there. The error then nearly reaches the bound, so a bound that left out or shrank
    either term would be broken here."""
    g = torch.Generator().manual_seed(7)
    d = 211
    levels = torch.randint(0, STATE_LEVELS - 1, (d,), generator=g).double()
    x = (levels + 0.499) / STATE_LEVELS
    x[0], x[1] = 0.0, 1.0  # the row's min and max
    hn = torch.nn.functional.normalize((x - 0.5)[None], dim=1)  # x is invariant to the shift and scale
    step = 0.37
    k = torch.randint(1, ADDRESS_LEVELS, (d,), generator=g).double()  # grid values, all positive
    v = step * (k + 0.499 * torch.sign(hn[0]))
    v[0] = step * ADDRESS_LEVELS  # the row's largest entry sets the step, on the grid
    op = AloeOperator(addresses=v[None].float(), thresholds=torch.zeros(1), temperatures=torch.ones(1), writes=torch.zeros(1, 2))
    score, slack = _screen(op).bounds(hn.float())
    error = float((hn @ v.double()[:, None])[0, 0] - score.double()[0, 0])
    assert abs(error) <= float(slack)
    assert abs(error) >= 0.9 * float(slack)


def test_int8_product_does_not_saturate():
    """All-maximal x and addresses of one sign: every u8 x s8 pair sum is 2 * 255 * 63 (AVX2's 16 bits hold it)."""
    d, n = 1536, 3
    h = torch.full((2, d), 1.0)
    h[:, 0] = -1.0  # the row's minimum: every other entry of x is exactly 1
    addresses = torch.ones(n, d) * torch.tensor([[5.0], [-5.0], [0.5]])
    op = AloeOperator(addresses=addresses, thresholds=torch.zeros(n), temperatures=torch.ones(n), writes=torch.zeros(n, 2))
    hn = normalize_rows(h, op.eps)
    score, slack = _screen(op).bounds(hn)
    exact = hn.double() @ addresses.double().T
    assert bool(((exact - score.double()).abs() <= slack.double()).all())
    assert ADDRESS_LEVELS * STATE_LEVELS * 2 < 2**15


def test_edges_zero_rows_all_closed_all_open_and_small_sizes():
    h = _outlier_states(9, 97, 3)
    h[4] = 0.0
    shut = random_operator(257, 97, 13, seed=1)
    shut.thresholds.fill_(5.0)  # unit addresses: no score reaches 5
    y0, y = _run(h, shut)
    assert torch.equal(y, y0)
    assert _screen(shut).kept(normalize_rows(h, shut.eps)).numel() == 0
    wide = random_operator(257, 97, 13, seed=2)
    wide.thresholds.fill_(-5.0)  # every gate open for every nonzero row
    assert _screen(wide).kept(normalize_rows(h, wide.eps)).numel() == 257
    _check_against_float64(h, wide)
    for T, n in ((1, 1), (1, 257), (9, 1)):
        op = random_operator(n, 97, 13, seed=T + n)
        op.thresholds.fill_(0.05)
        _check_against_float64(_outlier_states(T, 97, n), op)
    empty = torch.zeros(0, 97)
    _, y = _run(empty, wide)
    assert y.shape == (0, 13)


def test_past_the_token_cap_the_fp32_path_runs():
    h, op = operator_near_its_floors(4, T=INT8_SCREEN_MAX_TOKENS + 33)
    _check_against_float64(h, op)


def test_screen_prepared_for_another_operator_is_refused():
    op = random_operator(10, 97, 13)
    other = Int8Screen.prepare(op.addresses[:4], op.thresholds[:4], op.temperatures[:4], op.gate_eps)
    with pytest.raises(ValueError, match="4 edits"):
        int8_screened_residual_(
            torch.zeros(2, 13),
            torch.randn(2, 97),
            other,
            op.addresses,
            op.thresholds,
            op.temperatures,
            op.writes,
            op.eps,
            op.gate_eps,
        )


def test_the_screen_drops_most_edits_of_served_like_operators():
    """What the path is for: far fewer edits rescored than the operator holds (half never open here)."""
    h, op = operator_near_its_floors(5, T=32)
    kept = _screen(op).kept(normalize_rows(h, op.eps))
    assert kept.numel() < 0.75 * op.n
    # the half whose threshold (40) no score reaches is nearly all screened out
    assert int((kept >= op.n // 2).sum()) <= 0.05 * (op.n // 2)
