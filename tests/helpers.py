"""Shared test helpers: random operators with controllable gate activity."""

from __future__ import annotations

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
    thresholds[rows.shape[0]:] = 2.0  # a unit score can never reach 2: closed
    return AloeOperator(
        addresses=addresses,
        thresholds=thresholds,
        temperatures=torch.full((n,), 30.0, dtype=torch.float64),
        writes=torch.randn(n, d_out, generator=g, dtype=torch.float64),
    ).to(dtype=dtype)
