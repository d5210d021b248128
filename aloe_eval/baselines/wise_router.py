"""WISE's router: a module in place of one MLP down-projection that computes the main output and the
side memories' outputs, and hands on, per sequence, the one its activation score picks.

**Activation score** (EasyEdit's ``euc``): for down-projection input ``a`` at a token,

    s(a) = || act(W_side a) - act(W_main a) ||_2,

``act`` the model's MLP activation (``config.hidden_act``, SiLU for Llama-family models; EasyEdit applies
it to both outputs). A sequence's score is the mean of ``s`` over its tokens in the current forward call;
over the maximum instead when the call holds more than ``long_sequence`` (100) of them. Padding is left
out: the tokens of a row are those its attention mask keeps (the reference runs one unpadded sequence per
call; in a batch it would average across the batch).

**Routing** (EasyEdit's ``retrieve: true`` branch, the published default): with threshold
``t = act_ratio * (smallest in-scope score seen while editing the memory)``,

* the current side memory answers when its score is at least its threshold, else the main weight;
* then each saved memory in turn takes over when its score is above both its own threshold and the best
  score so far (which starts at the current side memory's score, whether or not that one answered).

A decision is made per sequence and per forward call: a teacher-forced pass decides once over the prompt
and its continuation; incremental decoding decides at the prompt (its tokens), then at every generated
token on that token alone, as ``model.generate`` does in the reference.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["WiseDownProj", "sequence_scores", "token_scores"]

#: a call with more tokens than this is scored by its largest token score (EasyEdit's ``infer`` rule)
LONG_SEQUENCE = 100


def token_scores(main: torch.Tensor, side: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``|| act(side) - act(main) ||_2`` at every token: (..., d_out) -> (...)."""
    return torch.linalg.vector_norm(act(side) - act(main), dim=-1)


def sequence_scores(scores: torch.Tensor, mask: torch.Tensor | None, long_sequence: int | None = LONG_SEQUENCE) -> torch.Tensor:
    """One score per row of ``scores`` (B, T): the mean over the tokens ``mask`` (B, T) keeps (all when
    None), or their maximum where a row keeps more than ``long_sequence`` (None: always the mean)."""
    keep = torch.ones_like(scores, dtype=torch.bool) if mask is None else mask.to(torch.bool)
    w = keep.to(scores.dtype)
    count = w.sum(-1)
    mean = (scores * w).sum(-1) / count.clamp_min(1)
    if long_sequence is None:
        return mean
    peak = scores.masked_fill(~keep, float("-inf")).amax(-1)
    return torch.where(count > long_sequence, peak, mean)


class WiseDownProj(nn.Module):
    """``base`` (the main down-projection) with side memories routed in per sequence.

    ``side`` and each of ``memories`` are (d_out, d) weights in ``nn.Linear`` layout; their outputs keep
    ``base``'s bias, if any. ``thresholds`` are already scaled by ``act_ratio``: one for ``side`` and
    one per memory. While ``editing`` the side output is returned for every token and ``outputs`` keeps
    ``(main, side)`` for the losses. ``attention_mask`` is the current forward's mask (B, past + T),
    set by :meth:`mask_hook`; without one every token counts.
    """

    def __init__(
        self,
        base: nn.Module,
        side: torch.Tensor,
        side_threshold: float,
        memories: Sequence[torch.Tensor],
        memory_thresholds: Sequence[float],
        act: Callable[[torch.Tensor], torch.Tensor],
        long_sequence: int | None = LONG_SEQUENCE,
    ):
        super().__init__()
        if len(memories) != len(memory_thresholds):
            raise ValueError("one threshold per memory")
        self.base = base
        self.side = side
        self.side_threshold = float(side_threshold)
        self.memories = list(memories)
        self.memory_thresholds = [float(t) for t in memory_thresholds]
        self.act = act
        self.long_sequence = long_sequence
        self.editing = False
        self.outputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self.attention_mask: torch.Tensor | None = None
        self.last_choice: torch.Tensor | None = None  # per row: 0 main, 1 side, 2 + i memory i
        self.last_side_score: torch.Tensor | None = None  # per row: the side memory's activation score

    def project(self, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``h`` through ``weight`` (d_out, d) with the base's bias."""
        bias = getattr(self.base, "bias", None)
        return F.linear(h, weight.to(h.dtype), None if bias is None else bias.to(h.dtype))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        main = self.base(h)
        side = self.project(h, self.side)
        if self.editing:
            self.outputs = (main, side)
            return side
        return self.route(h, main, side)

    def token_mask(self, h: torch.Tensor) -> torch.Tensor | None:
        """The attention mask of the tokens in ``h`` (B, T, d): the last T columns of the forward's mask."""
        m = self.attention_mask
        if m is None or m.dim() != 2 or h.dim() != 3 or m.shape[0] != h.shape[0] or m.shape[1] < h.shape[1]:
            return None
        return m[:, -h.shape[1] :].to(h.device)

    def route(self, h: torch.Tensor, main: torch.Tensor, side: torch.Tensor) -> torch.Tensor:
        """Per sequence, the output the scores pick (see the module docstring)."""
        mask = self.token_mask(h)
        with torch.no_grad():
            best = sequence_scores(token_scores(main, side, self.act).float(), mask, self.long_sequence)
            choice = (best >= self.side_threshold).long()
        self.last_side_score = best
        outs = [main, side]
        for i, (weight, threshold) in enumerate(zip(self.memories, self.memory_thresholds)):
            out = self.project(h, weight)
            with torch.no_grad():
                s = sequence_scores(token_scores(main, out, self.act).float(), mask, self.long_sequence)
                take = (s > best) & (s > threshold)
                choice = torch.where(take, torch.full_like(choice, i + 2), choice)
                best = torch.where(take, s, best)
            outs.append(out)
        self.last_choice = choice
        picked = torch.stack(outs)[choice, torch.arange(h.shape[0], device=h.device)] if h.dim() == 3 else None
        if picked is None:  # an unbatched input is one sequence
            return outs[int(choice.reshape(-1)[0])]
        return picked

    def mask_hook(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A forward pre-hook (``with_kwargs``) for the whole model: keeps the call's attention mask."""
        self.attention_mask = kwargs.get("attention_mask")
