"""An exact int8 screen for CPUs without bf16 dot products (AVX2): PyTorch's int8 linear (fbgemm).

On such CPUs a bf16 screen is emulated and slower than the fp32 product it would save, so every step
multiplied its tokens by every fp32 address. This screen runs the same product in int8, about four
times faster, and bounds its error per (token, edit) pair, so an edit it drops cannot open:

- each address row is rounded to ``ADDRESS_LEVELS`` steps of ``s_v = max|v| / 63`` either side of 0
  (error at most ``s_v / 2`` per entry);
- each normalised state ``h`` (unit row) is mapped to ``x = (h - lo) / (hi - lo)`` in [0, 1] with its
  own ``lo = min h`` and ``hi = max h`` and rounded to ``STATE_LEVELS + 1`` levels (error at most
  ``1 / 510`` per entry of x). Every row with ``hi > lo`` then has 0 and 1 among its entries, so the
  linear's own (per-tensor) input quantization finds scale 1/255 and zero point 0 and keeps the levels;
- ``h . v_q = lo * sum(v_q) + (hi - lo) * (x . v_q)``, and the int8 product gives ``x_q . v_q`` exactly
  (32-bit sums; 7-bit addresses keep AVX2's 16-bit pair sums of u8 x s8 products, at most
  2 * 255 * 63 < 2^15, from saturating);
- so ``|h . v - screen score| <= s_v / 2 * |h|_1 + (hi - lo) / 510 * |v_q|_1``, plus float rounding
  (``FLOAT_MARGIN`` of the magnitudes involved).

An edit is kept when some token's screen score plus that bound reaches the edit's open floor; the kept
edits are scored again exactly (:func:`aloe_kernels.screened.rescore_kept_`), so the result equals
the fp32 path's. On the 7,819-edit CounterFact operator about 5% of edits survive a 32-token step of
held-out states (docs/results.md, "The whole stream").
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from .operator import AloeOperator
from .reference import normalize_rows, open_score_floor
from .residual import sparse_residual_
from .screened import rescore_kept_

__all__ = [
    "ADDRESS_LEVELS",
    "INT8_SCREEN_MAX_TOKENS",
    "STATE_LEVELS",
    "Int8Screen",
    "int8_screen_supported",
    "int8_screened_residual_",
]

#: Address levels either side of 0: 7 bits, so that u8 x s8 pair sums fit AVX2's 16 bits (2*255*63 < 2^15).
ADDRESS_LEVELS = 63
#: Levels of a state's [min, max] range above its minimum (8 bits).
STATE_LEVELS = 255
#: Most rows screened in one call: past this many tokens the union of the edits some token may open
#: is most of them, and the plain fp32 path is faster (docs/results.md, "The whole stream").
INT8_SCREEN_MAX_TOKENS = 64
#: Relative float32 rounding allowed for, per unit of ``(|lo| + hi - lo) * |v_q|_1``: the screen score
#: is a few float32 products of exact integers (about 1e-7 each); this is 200 times that.
FLOAT_MARGIN = 2e-5


def int8_screen_supported() -> bool:
    """Whether this PyTorch runs the int8 dynamic linear on CPU with fbgemm (the x86 and fbgemm quantized
    engines), whose 32-bit sums the bound relies on."""
    engine = getattr(torch.backends.quantized, "engine", "")
    return engine in ("x86", "fbgemm") and hasattr(torch.ops.quantized, "linear_dynamic")


@dataclass
class Int8Screen:
    """The int8 addresses (prepacked for the linear) and each edit's terms of the bound."""

    packed: object  # the linear's prepacked per-row int8 weight
    offset: torch.Tensor  # (n,) sum of the dequantised address row
    l1: torch.Tensor  # (n,) |dequantised row|_1
    half_step: torch.Tensor  # (n,) s_v / 2
    floor: torch.Tensor  # (n,) open floor: a score at or below it gives gate 0

    @property
    def n(self) -> int:
        return int(self.floor.shape[0])

    @classmethod
    def prepare(
        cls, addresses: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor, gate_eps: float
    ) -> "Int8Screen":
        """Quantise ``addresses`` (n, d) per row and pack them (a few hundred ms for 10,000 x 1,536)."""
        if not int8_screen_supported():
            raise RuntimeError("this PyTorch has no int8 dynamic linear on CPU (fbgemm); use the fp32 path")
        a = addresses.detach().float().cpu()
        n = a.shape[0]
        step = (a.abs().amax(dim=1) / ADDRESS_LEVELS).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(a / step[:, None]).clamp_(-ADDRESS_LEVELS, ADDRESS_LEVELS)
        with warnings.catch_warnings():  # PyTorch marks quantized tensors as deprecated; the op is what we use
            warnings.simplefilter("ignore")
            weight = torch._make_per_channel_quantized_tensor(
                q.to(torch.int8), step.double(), torch.zeros(n, dtype=torch.long), 0
            )
            packed = torch.ops.quantized.linear_prepack(weight, None)
        dq = q * step[:, None]
        return cls(
            packed=packed,
            offset=dq.sum(dim=1),
            l1=dq.abs().sum(dim=1),
            half_step=step / 2,
            floor=open_score_floor(thresholds.detach().float().cpu(), temperatures.detach().float().cpu(), gate_eps),
        )

    def bounds(self, hn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Screen scores and their error bounds, both (T, n), of the unit or zero rows ``hn`` (T, d):
        every exact score ``hn @ addresses.T`` lies within the bound of the screen score."""
        lo = hn.amin(dim=1, keepdim=True)
        span = hn.amax(dim=1, keepdim=True) - lo
        x = torch.round((hn - lo) / span.clamp_min(torch.finfo(torch.float32).tiny) * STATE_LEVELS) / STATE_LEVELS
        product = torch.ops.quantized.linear_dynamic(x.contiguous(), self.packed, False)  # (T, n) = x_q . v_q
        score = lo * self.offset + span * product
        slack = (
            self.half_step * hn.abs().sum(dim=1, keepdim=True)
            + (span * (0.5 / STATE_LEVELS) + FLOAT_MARGIN * (lo.abs() + span)) * self.l1
        )
        return score, slack

    def kept(self, hn: torch.Tensor) -> torch.Tensor:
        """Indices of the edits that some row of ``hn`` (T, d), unit or zero rows, may open."""
        score, slack = self.bounds(hn)
        return ((score + slack).amax(dim=0) >= self.floor).nonzero().squeeze(1)


def int8_screened_residual_(
    y: torch.Tensor,
    h: torch.Tensor,
    screen: Int8Screen,
    addresses: torch.Tensor,
    thresholds: torch.Tensor,
    temperatures: torch.Tensor,
    writes: torch.Tensor,
    eps: float,
    gate_eps: float,
) -> torch.Tensor:
    """``y += U g(h)`` (in place): the int8 screen over all edits, exact fp32 gates for those it keeps.

    ``screen`` must have been prepared from these ``addresses`` and gate parameters; the result
    equals the fp32 path's (every edit that opens for some token is kept).
    """
    d = addresses.shape[1]
    h2 = h.reshape(-1, d)
    if h2.shape[0] == 0 or screen.n == 0:
        return y
    if screen.n != addresses.shape[0]:
        raise ValueError(f"the screen holds {screen.n} edits, the operator {addresses.shape[0]}")
    if h2.shape[0] > INT8_SCREEN_MAX_TOKENS:  # a prefill's union of kept edits is most of them
        return sparse_residual_(y, h2, AloeOperator.unchecked(addresses, thresholds, temperatures, writes, eps, gate_eps))
    kept = screen.kept(normalize_rows(h2, eps))
    return rescore_kept_(y, h2, kept, addresses, thresholds, temperatures, writes, eps, gate_eps)
