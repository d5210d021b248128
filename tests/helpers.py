"""Shared test helpers: random operators with controllable gate activity."""

from __future__ import annotations

import math

import torch

from aloe_kernels import AloeOperator


def random_operator(n: int, d: int, d_out: int, dtype=torch.float32, seed: int = 0, **kw) -> AloeOperator:
    """Random unit addresses, thresholds near 0.3, temperatures around 10."""
    g = torch.Generator().manual_seed(seed)
    addresses = torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1)
    return AloeOperator(
        addresses=addresses.to(dtype),
        thresholds=(0.3 + 0.1 * torch.rand(n, generator=g, dtype=torch.float64)).to(dtype),
        temperatures=(5 + 10 * torch.rand(n, generator=g, dtype=torch.float64)).to(dtype),
        writes=torch.randn(n, d_out, generator=g, dtype=torch.float64).to(dtype),
        **kw,
    )


def operator_opening_on(h: torch.Tensor, n_extra: int, d_out: int, seed: int = 0, dtype=torch.float32) -> AloeOperator:
    """An operator whose first h.shape[0] edits open exactly on the rows of h
    (address = the row's direction) and whose n_extra others stay closed."""
    rows = torch.nn.functional.normalize(h.reshape(-1, h.shape[-1]).double(), dim=1)
    g = torch.Generator().manual_seed(seed)
    extra = torch.nn.functional.normalize(torch.randn(n_extra, h.shape[-1], generator=g, dtype=torch.float64), dim=1)
    addresses = torch.cat([rows, extra])
    n = addresses.shape[0]
    thresholds = torch.full((n,), 0.9, dtype=torch.float64)
    thresholds[rows.shape[0] :] = 2.0  # a unit score can never reach 2: closed
    return AloeOperator(
        addresses=addresses,
        thresholds=thresholds,
        temperatures=torch.full((n,), 30.0, dtype=torch.float64),
        writes=torch.randn(n, d_out, generator=g, dtype=torch.float64),
    ).to(dtype=dtype)


def operator_near_its_floors(seed: int, T: int = 96, d: int = 256, d_out: int = 24, n: int = 400):
    """Served-like: h (T, d) and an operator whose first half of edits have floors within +-0.3 of an exact score
    (some open barely, some stay shut barely), addresses of norms 90-170, temperatures 0.7-160."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, d, generator=g).relu() * 3.0
    hn = torch.nn.functional.normalize(h, dim=1)
    norms = 90.0 + 80.0 * torch.rand(n, generator=g)
    dirs = torch.nn.functional.normalize(torch.randn(n, d, generator=g), dim=1)
    half = n // 2
    rows = torch.randint(0, T, (half,), generator=g)
    dirs[:half] = torch.nn.functional.normalize(hn[rows] + 0.3 * torch.randn(half, d, generator=g) / d**0.5, dim=1)
    addresses = dirs * norms[:, None]
    temperatures = torch.exp(torch.empty(n).uniform_(math.log(0.7), math.log(160.0), generator=g))
    gate_eps = 1e-3
    exact = (hn[rows].double() * addresses[:half].double()).sum(1).float()
    floor_shift = math.log(gate_eps / (1 - gate_eps)) / temperatures[:half]
    thresholds = torch.full((n,), 40.0)  # the other half never opens
    thresholds[:half] = exact + (torch.rand(half, generator=g) - 0.5) * 0.6 - floor_shift
    op = AloeOperator(
        addresses=addresses,
        thresholds=thresholds,
        temperatures=temperatures,
        writes=torch.randn(n, d_out, generator=g),
        gate_eps=gate_eps,
    )
    return h, op


def stopping_at(call: int, real, calls: list):
    """``real``, each call recorded in ``calls`` (its positional arguments), raising KeyboardInterrupt at the
    ``call``-th call instead: how a test interrupts a long run at a known point."""

    def stub(*args, **kwargs):
        calls.append(args)
        if len(calls) == call:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    return stub


def running_mean_by_hand(h: torch.Tensor, decay: float, valid=None, carry=None) -> torch.Tensor:
    """The running reading of states h (B, T, d), one position at a time in float64:
    r_t = decay r_{t-1} + unit(h_t), padding (``valid`` false) counting as zero."""
    h = h.double()
    r = torch.zeros(h.shape[0], h.shape[2], dtype=torch.float64) if carry is None else carry.double().clone()
    out = []
    for t in range(h.shape[1]):
        u = h[:, t] / h[:, t].norm(dim=-1, keepdim=True).clamp_min(1e-6)
        if valid is not None:
            u = u * valid[:, t, None].double()
        r = decay * r + u
        out.append(r)
    return torch.stack(out, 1)
