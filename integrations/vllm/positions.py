"""The tokens of a vLLM step whose next token is sampled: the only rows where
``write_positions="generated"`` keeps the residual (:mod:`aloe_kernels.write_positions`).

vLLM flattens a step's requests into one token axis; the attention metadata's ``query_start_loc``
marks where each request's tokens start, so the last token of each request's query is the one whose
logits are sampled: the prompt's last token in a prefill, the one new token in a decode step. A
chunked prefill's earlier chunks also end in such a token; that one prompt position per chunk is
written too. With speculative decoding a step verifies several draft tokens of a request, and only
the last of them is written: not supported yet. Without attention metadata (vLLM's profiling run),
and while a CUDA graph is captured (its replays would not see a new step's requests), every row
keeps the residual.

``aloe_vllm::restore_unsampled_rows_`` is a custom op so that torch.compile treats it as opaque and
reads the step's metadata at run time rather than tracing it.
"""

from __future__ import annotations

import torch

from vllm.forward_context import get_forward_context, is_forward_context_available


def sampled_rows() -> torch.Tensor | None:
    """Row indices of this step's last query token of each request, or None (keep every row)."""
    if not is_forward_context_available():
        return None
    meta = get_forward_context().attn_metadata
    if not isinstance(meta, dict) or not meta:
        return None
    starts = getattr(next(iter(meta.values())), "query_start_loc", None)
    if not isinstance(starts, torch.Tensor) or starts.numel() < 2:
        return None
    return starts[1:].long() - 1


@torch.library.custom_op("aloe_vllm::restore_unsampled_rows_", mutates_args=("y",))
def restore_unsampled_rows_(y: torch.Tensor, before: torch.Tensor) -> None:
    """Rows of ``y`` (tokens, d) whose next token is not sampled this step take back ``before``'s values."""
    rows = sampled_rows()
    if rows is None or (y.is_cuda and torch.cuda.is_current_stream_capturing()):
        return
    rows = rows.to(y.device)
    written = torch.zeros(y.shape[0], dtype=torch.bool, device=y.device)
    written[rows[(rows >= 0) & (rows < y.shape[0])]] = True
    y.copy_(torch.where(written.unsqueeze(-1), y, before))


@restore_unsampled_rows_.register_fake
def _restore_fake(y, before) -> None:
    return None
