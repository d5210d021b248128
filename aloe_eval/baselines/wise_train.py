"""Training WISE's side memory on one edit (EasyEdit's ``WISE.edit``).

Every step feeds the edit's rows (:mod:`.wise_inputs`) through the model with the side weight answering
at every token, and minimises

    target loss (in-scope rows)
    + mean of the positive parts of  s_out - s_in[r] + gamma   over the in-scope rows r
    + mean of the positive parts of  s_out - alpha
    + mean of the positive parts of  beta - s_in[r]

(each term 0 when nothing is positive), ``s_in[r]`` the activation score of in-scope row r and ``s_out``
that of the unrelated row (:mod:`.wise_router`, means over each row's tokens, padding left out): the
in-scope rows are pushed above ``beta``, the unrelated one below ``alpha``, with a gap of at least
``gamma``. SGD (``edit_lr``, weight decay 1e-5 on the whole weight) steps on the side weight with the
gradient kept only where the shard's random mask is 1 (knowledge sharding), and the weight is clamped to
within ``norm_constraint`` of the main weight, elementwise. At most ``n_iter`` steps; the loop stops,
before stepping, once the previous loss was at most 0.02 and within 1e-4 of the one before. The edit's
in-scope score, the mean of ``s_in`` on the last pass scored, feeds the threshold.

The layers below the edited one do not depend on the side weight: where the model allows it (checked
against a full pass once), their output is computed once per edit and each step runs only the layers
from the edited one up (:class:`UpperForward`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from aloe_build.forward import StopForward, run_until_stopped
from aloe_kernels.hf import decoder_layers

from .wise_inputs import EditBatch, target_loss
from .wise_router import WiseDownProj, sequence_scores, token_scores

__all__ = ["UpperForward", "margin_loss", "train_edit"]

#: EasyEdit's early stop: the previous loss at most this, and within STOP_DELTA of the one before
STOP_LOSS, STOP_DELTA = 0.02, 1e-4


@dataclasses.dataclass(frozen=True)
class Margins:
    """The activation margins: unrelated rows below ``alpha``, in-scope rows above ``beta``, apart by ``gamma``."""

    alpha: float
    beta: float
    gamma: float


def _positive_mean(x: torch.Tensor) -> torch.Tensor:
    pos = x[x > 0]
    return pos.mean() if pos.numel() else x.new_zeros(())


def margin_loss(s_in: torch.Tensor, s_out: torch.Tensor, m: Margins) -> torch.Tensor:
    """WISE's activation margins: ``s_in`` (in-scope rows,), ``s_out`` (unrelated rows,)."""
    gap = s_out.view(-1, 1) - s_in.view(1, -1) + m.gamma
    return _positive_mean(gap) + _positive_mean(s_out - m.alpha) + _positive_mean(m.beta - s_in)


def row_scores(wrapper: WiseDownProj, batch: EditBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(in-scope row scores, unrelated row scores) of the latest editing pass."""
    main, side = wrapper.outputs
    s = sequence_scores(token_scores(main.float(), side.float(), wrapper.act), batch.attention_mask, None)
    return s[: batch.n_in_scope], s[batch.n_in_scope :]


def train_edit(
    forward: Callable[[], torch.Tensor],
    wrapper: WiseDownProj,
    batch: EditBatch,
    grad_mask: torch.Tensor,
    main_weight: torch.Tensor,
    cfg: Any,
) -> dict[str, float]:
    """Train ``wrapper.side`` in place on one edit; ``forward()`` runs the batch and returns its logits
    (last ``batch.keep`` positions at least). ``cfg``: a :class:`.wise.WiseConfig`. Returns the edit's
    in-scope score and the record of the optimization."""
    margins = Margins(cfg.alpha, cfg.beta, cfg.gamma)
    # a leaf tensor, not an nn.Parameter: the router keeps it as a plain attribute, outside the model's parameters
    param = wrapper.side.detach().clone().requires_grad_(True)
    wrapper.side = param
    opt = torch.optim.SGD([param], lr=cfg.edit_lr, weight_decay=cfg.weight_decay)
    prev, last = 0.0, 1e9  # EasyEdit's EarlyStopMeter
    log: dict[str, float] = {}
    wrapper.editing = True
    try:
        for step in range(cfg.n_iter):
            ft = target_loss(forward(), batch)
            s_in, s_out = row_scores(wrapper, batch)
            act = margin_loss(s_in, s_out, margins)
            loss = ft + act
            if step == 0:
                log.update(loss_first=float(loss.detach()), target_loss_first=float(ft.detach()))
            stop = abs(last - prev) <= STOP_DELTA and last <= STOP_LOSS
            if stop or step == cfg.n_iter - 1:
                log.update(score=float(s_in.detach().mean()), score_out=float(s_out.detach().mean()))
                log.update(loss_last=float(loss.detach()), target_loss_last=float(ft.detach()), steps=step)
            if stop:
                break
            opt.zero_grad()
            loss.backward()
            param.grad.mul_(grad_mask.view_as(param.grad))
            opt.step()
            prev, last = last, float(loss.detach())
            if cfg.norm_constraint is not None:
                with torch.no_grad():
                    param.copy_(torch.clamp(param, min=main_weight - cfg.norm_constraint, max=main_weight + cfg.norm_constraint))
        else:
            log["steps"] = cfg.n_iter
    finally:
        wrapper.editing = False
        wrapper.outputs = None
        wrapper.side = param.detach()
    return log


class UpperForward:
    """Runs a batch through the model from decoder layer ``layer`` up, that layer's input computed once
    by :meth:`prepare`; :attr:`enabled` is False (every call a full pass) where the model cannot start
    at a layer (its decoder must take ``inputs_embeds`` as the first layer's input, as Llama-family
    models do; GPT-2 adds position embeddings to them) or where :meth:`check` finds a difference."""

    def __init__(self, model: nn.Module, layer: int):
        self.model, self.layer = model, layer
        self.path, self.layers = decoder_layers(model)
        self.enabled = self.path == "model.layers" and layer > 0
        self.h: torch.Tensor | None = None
        self.inputs: dict[str, torch.Tensor] = {}

    def prepare(self, inputs: dict[str, torch.Tensor]) -> None:
        """Keep ``inputs`` and, when enabled, the input of the layer for them."""
        self.inputs = inputs
        if not self.enabled:
            return
        box: dict[str, torch.Tensor] = {}

        def grab(_m, args, kwargs):
            box["h"] = (args[0] if args else kwargs["hidden_states"]).detach()
            raise StopForward

        handle = self.layers[self.layer].register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                run_until_stopped(self.model, **inputs, use_cache=False)
        finally:
            handle.remove()
        self.h = box["h"]

    def __call__(self, keep: int, rows: int | None = None) -> torch.Tensor:
        """The logits of the last ``keep`` positions of the first ``rows`` rows (None: all)."""
        if not self.enabled:
            return self.model(**self.inputs, use_cache=False, logits_to_keep=keep).logits[:rows]
        rest = {k: v for k, v in self.inputs.items() if k != "input_ids"}
        with self._upper_layers():
            hidden = self.decoder(inputs_embeds=self.h, **rest, use_cache=False).last_hidden_state
        # the output head on the kept positions as one contiguous 2-D product (the model's own head
        # multiplies a strided 3-D slice, several times slower on a CPU)
        x = hidden[:rows, -keep:].reshape(-1, hidden.shape[-1]).contiguous()
        head = self.model.get_output_embeddings()
        return F.linear(x, head.weight, head.bias).view(-1, keep, head.weight.shape[0])

    @contextlib.contextmanager
    def _upper_layers(self):
        inner = self.decoder
        inner.layers = nn.ModuleList(list(self.layers)[self.layer :])
        try:
            yield
        finally:
            inner.layers = self.layers

    @property
    def decoder(self) -> nn.Module:
        """The module that holds the decoder layers (and runs them and the final norm)."""
        return self.model.get_submodule(self.path.rsplit(".", 1)[0])

    def check(self, keep: int) -> bool:
        """Compare a pass from the layer with a full pass on the prepared batch; disable on a difference
        (a model whose head does more than its output embedding, or whose layers need more than
        ``inputs_embeds``)."""
        if self.enabled:
            with torch.no_grad():
                upper = self(keep)
                full = self.model(**self.inputs, use_cache=False, logits_to_keep=keep).logits
            self.enabled = upper.shape == full.shape and bool(torch.allclose(upper, full, rtol=1e-4, atol=1e-4))
        return self.enabled
