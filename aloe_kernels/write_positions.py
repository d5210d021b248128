"""Which token positions receive the operator's residual when a model is served.

An edit changes what the model says next, so its write is needed only where the model's next token
is generated: the last token of the prompt, then every generated token. Added at earlier prompt
positions as well (``"all"``, the operator's plain definition), a write made where the context merely
*mentions* the edited fact (a statement earlier in the conversation, a retrieved passage) reaches
later questions through attention, and answers about other subjects change or take the edit's
target. ``"generated"`` (the default) leaves those positions as the unedited model computes them.

In one forward call of several positions, "generated" means the last position of each row: the
prompt's last token in the prefill of a left-padded batch (as ``model.generate`` pads), and the one
token of each decode step. A caller that scores a continuation teacher-forced says where each row's
generated part starts (:func:`aloe_kernels.hf.written_from`).
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

WRITE_POSITIONS = ("generated", "all")
DEFAULT_WRITE_POSITIONS = "generated"


def check_write_positions(value: str) -> str:
    """``value`` if it names a policy, else a ValueError that lists them."""
    if value not in WRITE_POSITIONS:
        raise ValueError(f"write_positions must be one of {', '.join(WRITE_POSITIONS)}; got {value!r}")
    return value


def add_write_positions_argument(parser: argparse.ArgumentParser) -> None:
    """``--write-positions {generated,all}`` on a command line (default: :data:`DEFAULT_WRITE_POSITIONS`)."""
    parser.add_argument(
        "--write-positions",
        default=DEFAULT_WRITE_POSITIONS,
        choices=WRITE_POSITIONS,
        help="where the operator adds its residual: 'generated' (default) only where the next token is "
        "generated, 'all' at every position as well (see aloe_kernels.write_positions)",
    )


def add_at_written_positions(
    y: torch.Tensor,
    h: torch.Tensor,
    add: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    starts: torch.Tensor | None,
) -> torch.Tensor:
    """``add(y, h)`` (which returns y plus the residual) applied only at the written positions of
    ``y``/``h`` (shape ``(..., T, d)``): from ``starts[b]`` on in row b when given (a tensor of the
    leading shape), else the last position. Positions not written keep ``y``'s bits."""
    if h.dim() < 2 or (starts is None and h.shape[-2] == 1):
        return add(y, h)
    if starts is None:
        last = add(y[..., -1:, :].contiguous(), h[..., -1:, :].contiguous())
        return torch.cat([y[..., :-1, :], last], dim=-2)
    written = torch.arange(h.shape[-2], device=h.device) >= starts.to(h.device).unsqueeze(-1)
    return torch.where(written.unsqueeze(-1), add(y.clone(), h), y)
