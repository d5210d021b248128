"""The screened CPU path: ``y += U g(h)`` with a bf16 screen over all edits and exact fp32 gates
for the few that may open.

Scores are screened with a bf16 GEMM (AMX/AVX512-BF16 on CPUs that have them)
of the normalised h against a bf16 copy of the addresses, and only the edits
that may open are scored again exactly in fp32. The result is the same as the
fp32 sparse path (each edit's screening margin exceeds its worst-case bf16
error, which grows with the address's norm), at
a fraction of the cost of an fp32 T x n x d GEMM.
"""

from __future__ import annotations

from typing import Callable

import torch

from .operator import AloeOperator
from .reference import normalize_rows, open_score_floor
from .residual import sparse_residual_

__all__ = ["SCREEN_MARGIN", "SCREEN_MIN_EDITS", "fast_bf16_cpu", "rescore_kept_", "screen_limit", "screened_residual_"]

#: Margin of the screen per unit of ``max(1, |address|, |open floor|)``: each edit's bf16 limit is its
#: open floor minus this times that scale. Worst case of |bf16 score - exact score| with |h/|h|| = 1
#: and an address of norm A: rounding h and the address to bf16 (2 * 2^-9 * A, by Cauchy-Schwarz),
#: fp32 accumulation over d <= 16k (< 1e-3 * A), rounding the score to bf16 (2^-9 * A) and the
#: limit to bf16 (2^-9 * |limit|): under 0.009 * max(A, |floor|) (1.0125 |floor| >= |limit|).
#: Built addresses are not unit vectors (norms of about 90-170 on SmolLM2), so a margin that
#: ignored the norm dropped gates that open (2 of 4,239 on the requests of a real operator).
SCREEN_MARGIN = 0.0125
#: Fewest edits for which a screen pays by default: below it the whole fp32 product is cheap.
SCREEN_MIN_EDITS = 256


def screen_limit(addresses: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor, gate_eps: float) -> torch.Tensor:
    """Per-edit bf16 limit of the screen: the open floor minus :data:`SCREEN_MARGIN` scaled by the
    larger of 1, the address's norm and the floor's magnitude."""
    floor = open_score_floor(thresholds.float(), temperatures.float(), gate_eps)
    norm = torch.linalg.vector_norm(addresses.float(), dim=1)
    scale = torch.maximum(torch.maximum(norm, floor.abs()), torch.ones_like(norm))
    return (floor - SCREEN_MARGIN * scale).to(torch.bfloat16)


def screened_residual_(
    y: torch.Tensor,
    h: torch.Tensor,
    addresses_lo: torch.Tensor,
    limit_lo: torch.Tensor,
    addresses: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float,
    gate_eps: float,
    screen_gemm: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``y += U g(h)`` (in place): bf16 screen over all edits, exact fp32 gates for the few that may open.

    An edit is kept when its bf16 score exceeds ``limit_lo`` (:func:`screen_limit`)
    for some token; every edit whose exact score reaches its open floor is kept
    (see :data:`SCREEN_MARGIN`), so the gates equal the fp32 path's. The screen
    scores are ``screen_gemm(hb)`` of the normalised bf16 rows ``hb`` (T, d)
    when given (e.g. a GEMM over a prepacked copy of the addresses), else
    ``hb @ addresses_lo.T``; either way (T, n) bf16.
    """
    d = addresses.shape[1]
    h2 = h.reshape(-1, d)
    if h2.shape[0] == 0 or addresses.shape[0] == 0:
        return y
    hn = normalize_rows(h2, eps)
    raw = screen_gemm(hn.to(torch.bfloat16)) if screen_gemm is not None else hn.to(torch.bfloat16) @ addresses_lo.T
    best = raw.amax(dim=0)  # (n,): one pass over the bf16 scores
    return rescore_kept_(
        y, h2, (best > limit_lo).nonzero().squeeze(1), addresses, thresholds, temperatures, writes, eps, gate_eps
    )


def rescore_kept_(
    y: torch.Tensor,
    h: torch.Tensor,
    kept: torch.Tensor,
    addresses: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float,
    gate_eps: float,
) -> torch.Tensor:
    """``y += U g(h)`` (in place) over the edits ``kept`` by a screen, through the fp32 sparse path
    (:func:`aloe_kernels.residual.sparse_residual_`) on those rows; the screen guarantees that every
    other edit's gate is 0 for every row of ``h`` (T, d)."""
    if kept.numel() == 0:
        return y
    rows = AloeOperator.unchecked(
        addresses.index_select(0, kept),
        thresholds.index_select(0, kept),
        temperatures.index_select(0, kept),
        writes.index_select(0, kept),
        eps,
        gate_eps,
    )
    return sparse_residual_(y, h, rows)


def fast_bf16_cpu() -> bool:
    """Whether this CPU has native bf16 dot products (AMX or AVX512-BF16), which make the screen pay off."""
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(torch.cpu, probe, None)
        try:
            if fn is not None and fn():
                return True
        except Exception:  # pragma: no cover - probe unavailable
            pass
    return False
