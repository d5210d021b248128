"""int8 addresses with a provable screen: half the address bytes of bf16 at decode, the same gates.

Format (per edit row v of the addresses, d columns in groups of :data:`GROUP`):

- ``values`` (n, d) int8: ``q = round(v / s)`` in [-127, 127], with one scale ``s`` per group;
- ``scales`` (n, ceil(d / GROUP)) float16: ``s = max |v_group| / 127``, rounded up to a float16 so
  that no ``|v / s|`` passes 127 (a group of zeros keeps scale 1 and values 0);
- ``error_norms`` (n,) float32: ``r = |v - v_hat|_2`` with ``v_hat = q * s`` (computed in float64,
  rounded up), the dequantisation error of the row;
- ``dequant_norms`` (n,) float32: ``|v_hat|_2``, rounded up (sizes the float slack below).

The screen. For a unit state ``u = h / max(|h|, eps)``, Cauchy-Schwarz gives
``|v . u - v_hat . u| <= r |u| <= r``, so ``v_hat . u + r`` bounds the exact score from above.
An edit's gate is 0 for a token whenever its exact score is at most the edit's open floor
(:func:`aloe_kernels.reference.open_score_floor`); a pair is skipped only when

    screen score + r + slack < floor - floor_margin

where ``slack`` covers float32 rounding in the screen's product (its per-group sums, scalings and
additions: at most ``(d + 2 groups + 4) 2^-24 |v_hat|``) and in the exact path's product (the same
factor times ``|v|``), with the norm of ``u`` taken as 1 + 1e-5, and ``floor_margin`` covers the
rounding of the gate's own evaluation near the floor (:data:`FLOOR_MARGIN`). A skipped pair's
gate is therefore exactly 0 in the full-precision operator, and every other pair is scored again
from the full-precision row:

- here, on CPU, :func:`int8_address_residual_` runs the kept edits through the sparse path;
- on a GPU, the streaming decode kernel takes the int8 values as a first pass and rescores the
  kept rows in the steps of a plain call, so its output has a plain call's bits
  (:func:`aloe_kernels.ops.stream_gate.run_stream_gate`, ``screen=``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .int8_format import GROUP, LEVELS
from .operator import AloeOperator
from .reference import normalize_rows, open_score_floor
from .screened import rescore_kept_

__all__ = ["FLOOR_MARGIN", "GROUP", "Int8Addresses", "int8_address_residual_", "kernel_screen"]

#: Margin below each open floor, per unit of ``max(1, |floor|, |threshold|)``: the gate's own
#: float32 evaluation (``alpha (s - tau)``, a sigmoid and a subtraction) can open a few ulps below
#: the exact floor; this is about 100 times that.
FLOOR_MARGIN = 1e-5
_U = 2.0**-24  # float32 unit roundoff
#: Bound on ``|u|_2`` for a normalised row computed in float32 (1 + a few ulps), with room.
UNIT_SLACK = 1.0 + 1e-5


def _round_up_f32(x: torch.Tensor) -> torch.Tensor:
    """float64 ``x`` as float32, never below it."""
    f = x.float()
    return torch.where(f.double() < x, torch.nextafter(f, torch.full_like(f, float("inf"))), f)


@dataclass
class Int8Addresses:
    """The int8 copy of an operator's addresses and the terms of its screen (see the module docstring)."""

    values: torch.Tensor
    scales: torch.Tensor
    error_norms: torch.Tensor
    dequant_norms: torch.Tensor

    @property
    def n(self) -> int:
        return int(self.values.shape[0])

    @property
    def d(self) -> int:
        return int(self.values.shape[1])

    @classmethod
    def quantize(cls, addresses: torch.Tensor) -> "Int8Addresses":
        """Quantise ``addresses`` (n, d), any float dtype; the result is on the addresses' device."""
        if addresses.dim() != 2 or not addresses.is_floating_point():
            raise ValueError(f"addresses must be a floating (n, d) tensor, got {addresses.dtype} {tuple(addresses.shape)}")
        v = addresses.detach().double()
        if not bool(torch.isfinite(v).all()):
            raise ValueError("addresses hold NaN or infinite values; they cannot be quantised")
        n, d = v.shape
        groups = -(-d // GROUP)
        padded = torch.nn.functional.pad(v, (0, groups * GROUP - d)).view(n, groups, GROUP)
        amax = padded.abs().amax(dim=2)
        scale = (amax / LEVELS).to(torch.float16)
        low = scale.double() * LEVELS < amax  # rounded below the need: step up one float16
        scale = torch.where(low, (scale.view(torch.int16) + 1).view(torch.float16), scale)  # next float16 up (>= 0)
        if bool(torch.isinf(scale).any()):
            raise ValueError("an address group is too large for a float16 scale (|v| > 8e6)")
        scale = torch.where(amax == 0, torch.ones_like(scale), scale)
        q = torch.round(padded / scale.double()[:, :, None]).clamp_(-LEVELS, LEVELS)
        hat = (q * scale.double()[:, :, None]).view(n, -1)[:, :d]
        return cls(
            values=q.view(n, -1)[:, :d].to(torch.int8).contiguous(),
            scales=scale.contiguous(),
            error_norms=_round_up_f32(torch.linalg.vector_norm(v - hat, dim=1)),
            dequant_norms=_round_up_f32(torch.linalg.vector_norm(hat, dim=1)),
        )

    def dequantized(self) -> torch.Tensor:
        """``v_hat`` (n, d) in float32 (exact: 8-bit values times 11-bit scales)."""
        s = self.scales.float().repeat_interleave(GROUP, dim=1)[:, : self.d]
        return self.values.float() * s

    def screen_limits(
        self, addresses: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor, gate_eps: float
    ) -> torch.Tensor:
        """(n,) float32: a pair may open only if its screen score ``u . v_hat`` reaches its edit's limit.

        ``floor - margin - r - slack`` (module docstring), computed in float64 and rounded down.
        """
        floor = open_score_floor(thresholds.double(), temperatures.double(), gate_eps)
        margin = FLOOR_MARGIN * torch.maximum(torch.maximum(floor.abs(), thresholds.double().abs()), torch.ones_like(floor))
        groups = -(-self.d // GROUP)
        norms = torch.linalg.vector_norm(addresses.double(), dim=1)
        slack = (self.d + 2 * groups + 4) * _U * (self.dequant_norms.double() + norms)
        limit = floor - margin - (self.error_norms.double() + slack) * UNIT_SLACK
        f = limit.float()
        return torch.where(f.double() > limit, torch.nextafter(f, torch.full_like(f, -float("inf"))), f)

    def may_open(
        self, units: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor, gate_eps: float
    ) -> torch.Tensor:
        """(T, n) bool: False where the pair is provably closed (its gate is 0 in the full operator).

        ``units``: unit (or zero) rows (T, d) in float32.
        """
        screen = units.float() @ self.dequantized().T
        return screen >= self.screen_limits(addresses, thresholds, temperatures, gate_eps)[None, :]

    def kept(
        self, units: torch.Tensor, addresses: torch.Tensor, thresholds: torch.Tensor, temperatures: torch.Tensor, gate_eps: float
    ) -> torch.Tensor:
        """Indices of the edits that some row of ``units`` may open (all others are provably closed)."""
        return self.may_open(units, addresses, thresholds, temperatures, gate_eps).any(dim=0).nonzero().squeeze(1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {
            "values": self.values,
            "scales": self.scales,
            "error_norms": self.error_norms,
            "dequant_norms": self.dequant_norms,
        }


def kernel_screen(op: AloeOperator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(values, scales, limits)`` of ``op``'s int8 addresses, on its device: the ``screen`` argument of
    :func:`aloe_kernels.ops.stream_gate.run_stream_gate`."""
    q = Int8Addresses.quantize(op.addresses)
    limits = q.screen_limits(op.addresses, op.thresholds, op.temperatures, op.gate_eps)
    return q.values, q.scales, limits.to(op.addresses.device)


def int8_address_residual_(y: torch.Tensor, h: torch.Tensor, q: Int8Addresses, op: AloeOperator) -> torch.Tensor:
    """``y += U g(h)`` in place: the int8 screen over all edits, exact gates for those it keeps.

    Equals :func:`aloe_kernels.residual.sparse_residual_` on ``op`` (every edit that opens for
    some token is kept, and kept edits take that same path).
    """
    if q.n != op.n or q.d != op.d:
        raise ValueError(f"the int8 addresses are {q.n} x {q.d}, the operator's {op.n} x {op.d}")
    h2 = h.reshape(-1, op.d)
    if h2.shape[0] == 0 or op.n == 0:
        return y
    kept = q.kept(normalize_rows(h2, op.eps), op.addresses, op.thresholds, op.temperatures, op.gate_eps)
    return rescore_kept_(y, h2, kept, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps)
