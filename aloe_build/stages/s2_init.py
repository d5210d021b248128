"""Stage 2: each slot's initial address, v_i = c Q^T norm(K h(t_i)), from its request state."""

from __future__ import annotations

from typing import Sequence

import torch

from ..states import last_token_states
from .s1_encoder import AddressEncoder


def initial_addresses(
    model, tokenizer, prompts: Sequence[str], layer: int, encoder: AddressEncoder, batch_size: int
) -> torch.Tensor:
    """The encoder's address (n, d) of each request's last-token state at ``layer``."""
    h_req = last_token_states(model, tokenizer, list(prompts), layer, batch_size, "stage 2: request states")
    return encoder.addresses(h_req).contiguous()
