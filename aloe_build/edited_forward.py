"""Forward passes of the edited model for the write stages (6 and 8), computed once up to the edit.

An edit adds ``U g(h)`` to the output of layer L's down-projection. Neither
``h`` (the down-projection input) nor anything below it depends on the
writes, so for each training sequence this module runs the model once, keeps
layer L's output without the edit and the gates of every slot that opens on
the sequence, and from then on every optimisation step only runs the layers
above L (and the output projection on the target positions), forward and
backward. On SmolLM2 at layer 22 that is 7 of 30 layers per step.

The upper-layer pass calls the decoder stack's own forward with the cached
hidden states as ``inputs_embeds`` and the layer list cut to the layers above
L. Models whose stack transforms ``inputs_embeds`` (GPT-2 adds position
embeddings, some scale them) would be computed wrongly that way: the first
batch is checked against a full forward and, if they differ, every step runs
the whole model with a hook on the down-projection instead.

Before the first position where any gate opens (and before the positions that
predict the target), layer L's output carries no write, so the upper layers'
keys and values there are the same at every step. They are computed once and
cached; each step runs the upper layers on the remaining positions only (on a
SmolLM2 chat form, a few positions of a few dozen).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm
from transformers import DynamicCache

from aloe_kernels import AloeOperator
from aloe_kernels.hf import _get, decoder_layers, locate_down_proj
from aloe_kernels.reference import gates_from_scores

from .config import BuildConfig
from .forward import StopForward, capture_down_proj_input, in_precision, model_device
from .shared_prefix import cache_layer_kv, left_padded_cache
from .states import normalize_rows, run_captured
from .tokens import batch_inputs, left_pad, pad_id

# Largest relative difference between the upper-layer pass and a full forward that
# still counts as the same computation (fp32 and bf16 reorderings stay far below it).
_SAME_LOGITS_RTOL = 1e-2


@dataclass
class SequenceGates:
    """The slots that open somewhere on one sequence and their gates at every position."""

    slots: torch.Tensor  # (k,) long
    gates: torch.Tensor  # (T, k) float32


def _hidden_of(output) -> torch.Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


class EditedForward:
    """Target NLL of prompt + target sequences with a residual added at the edited layer.

    ``seqs[i]`` is a training sequence of slot ``owners[i]`` (default: slot i) and
    ``target_lens[i]`` the number of its final tokens scored; ``op`` supplies the
    layer and the (frozen) gates. ``precision`` names the precision of its passes (a key of
    :data:`aloe_build.forward.PASS_DTYPES`).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        seqs: Sequence[Sequence[int]],
        target_lens: Sequence[int],
        op: AloeOperator,
        batch_size: int = 32,
        precision: str = "float32",
        desc: str = "gates and layer outputs",
        owners: Sequence[int] | None = None,
        cache_prefix: bool = True,
        held: Sequence[int] | None = None,
    ):
        self.model, self.seqs, self.target_lens = model, [list(s) for s in seqs], list(target_lens)
        self.layer, self.d_out, self.n_slots = op.layer, op.d_out, op.n
        self.owners = list(owners) if owners is not None else list(range(len(seqs)))
        # the sequences this process runs (a distributed build's rank: its slots'); None: all
        self.held = None if held is None else frozenset(held)
        self.device = model_device(model)
        self.pid = pad_id(tokenizer)
        self.precision = precision
        self.site = locate_down_proj(model, op.layer)
        path, self.layers = decoder_layers(model)
        parent_path, _, self.layers_attr = path.rpartition(".")
        self.stack = _get(model, parent_path) if parent_path else model
        self.hidden: list[torch.Tensor] = [torch.empty(0)] * len(seqs)
        self.gates: list[SequenceGates] = [SequenceGates(torch.empty(0, dtype=torch.long), torch.empty(0, 0))] * len(seqs)
        self.upper_only = True
        # per sequence: how many leading positions the upper layers see only through cached keys/values
        self.split = [0] * len(seqs)
        self.prefix_kv: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in seqs]
        self._prefix(op, batch_size, desc, cache_prefix)

    # ---- one pass up to the edited layer -------------------------------------------------

    def _prefix(self, op: AloeOperator, batch_size: int, desc: str, cache_prefix: bool) -> None:
        V, tau, alpha = (t.to(self.device, torch.float32) for t in (op.addresses, op.thresholds, op.temperatures))
        out: dict = {}

        def take_out(module, args, output):
            out["hidden"] = _hidden_of(output).detach()
            raise StopForward  # the layers above are not needed here

        here = range(len(self.seqs)) if self.held is None else sorted(self.held)
        order = sorted(here, key=lambda i: len(self.seqs[i]))  # similar lengths share a batch
        handle = self.layers[self.layer].register_forward_hook(take_out)
        try:
            with capture_down_proj_input(self.model, self.layer, stop=False) as box:
                for start in tqdm(range(0, len(order), batch_size), desc=desc, leave=False):
                    idx = order[start : start + batch_size]
                    inputs = batch_inputs([self.seqs[i] for i in idx], self.pid, self.device)
                    with self._autocast():
                        h = run_captured(self.model, box, **inputs)
                    width = inputs["input_ids"].shape[1]
                    g = gates_from_scores(normalize_rows(h, op.eps) @ V.T, tau, alpha, op.gate_eps)  # (B, W, n)
                    for row, i in enumerate(idx):
                        real = slice(width - len(self.seqs[i]), width)
                        gi = g[row, real]
                        slots = (gi > 0).any(0).nonzero().squeeze(1)
                        self.gates[i] = SequenceGates(slots.cpu(), gi[:, slots].float().cpu())
                        self.hidden[i] = out["hidden"][row, real].cpu()  # the model's dtype: the upper pass takes it as is
        finally:
            handle.remove()
        if order:
            self._check_upper_pass(order[:batch_size])
            if cache_prefix and self.upper_only:
                self._cache_prefixes(order, batch_size)
                self._check_upper_pass(order[:batch_size])  # the pass on the cache, too

    def _cache_prefixes(self, order: list[int], batch_size: int) -> None:
        """The upper layers' keys and values before each sequence's first open gate, computed once."""
        # a batch's logits are those of its last (longest target + 1) positions: every sequence keeps
        # at least that many after its cache, whichever batch it is in
        scored = max(self.target_lens) + 1
        for i in order:
            T = len(self.seqs[i])
            open_rows = (self.gates[i].gates > 0).any(1).nonzero()
            first_open = int(open_rows[0, 0]) if open_rows.numel() else T
            self.split[i] = max(0, min(first_open, T - scored))
        with_prefix = sorted((i for i in order if self.split[i]), key=lambda i: self.split[i])
        for start in range(0, len(with_prefix), batch_size):
            rows = with_prefix[start : start + batch_size]
            _, mask, positions = left_pad([[0] * self.split[i] for i in rows], 0, self.device)
            W = mask.shape[1]
            first = self.hidden[rows[0]]
            hidden = torch.zeros(len(rows), W, first.shape[-1], device=self.device, dtype=first.dtype)
            for b, i in enumerate(rows):
                hidden[b, W - self.split[i] :] = self.hidden[i][: self.split[i]].to(self.device)
            cache = DynamicCache()
            with torch.no_grad(), self._autocast(), self._upper_layers():
                self.stack(
                    inputs_embeds=hidden, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
                )
            kv = [cache_layer_kv(cache, j) for j in range(len(self.layers) - self.layer - 1)]
            for b, i in enumerate(rows):
                real = slice(W - self.split[i], W)
                self.prefix_kv[i] = [(k[b, :, real].cpu(), v[b, :, real].cpu()) for k, v in kv]

    def _check_upper_pass(self, rows: list[int]) -> None:
        """Use the upper-layer pass only if it reproduces the full forward's logits."""
        zero = torch.zeros(len(rows), self.width(rows), self.d_out, device=self.device)
        self.upper_only = True
        with torch.no_grad():
            fast = self.logits(rows, zero)
            self.upper_only = False
            full = self.logits(rows, zero)
        scale = full.abs().max().clamp_min(1e-6)
        self.upper_only = bool(torch.isfinite(fast).all() and ((fast - full).abs().max() / scale) < _SAME_LOGITS_RTOL)

    # ---- per-batch pieces ----------------------------------------------------------------

    def holds(self, rows: Sequence[int]) -> bool:
        """Whether this process ran every one of ``rows`` up to the edited layer."""
        return self.held is None or all(i in self.held for i in rows)

    def held_of(self, rows: Sequence[int]) -> list[int]:
        """Those of ``rows`` this process ran up to the edited layer, in order."""
        return list(rows) if self.held is None else [i for i in rows if i in self.held]

    def upper_positions(self, i: int) -> int:
        """Positions of sequence ``i`` that every step runs through the upper layers (after its cache)."""
        return len(self.seqs[i]) - self.split[i]

    def width(self, rows: Sequence[int]) -> int:
        return max(len(self.seqs[i]) for i in rows)

    def own_gates(self, rows: Sequence[int]) -> torch.Tensor:
        """(B, W) left-padded gate of the slot that owns sequence ``rows[b]``, on that sequence."""
        W = self.width(rows)
        out = torch.zeros(len(rows), W)
        for b, i in enumerate(rows):
            sg = self.gates[i]
            hit = (sg.slots == self.owners[i]).nonzero()
            if hit.numel():
                out[b, W - sg.gates.shape[0] :] = sg.gates[:, int(hit[0, 0])]
        return out.to(self.device)

    def all_gates(self, rows: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, G)``: the slots open anywhere in the batch and their (B, W, k) left-padded gates."""
        W = self.width(rows)
        slots = torch.unique(torch.cat([self.gates[i].slots for i in rows]))  # sorted
        G = torch.zeros(len(rows), W, len(slots))
        for b, i in enumerate(rows):
            sg = self.gates[i]
            if sg.slots.numel():
                G[b, W - sg.gates.shape[0] :, torch.searchsorted(slots, sg.slots)] = sg.gates
        return slots.to(self.device), G.to(self.device)

    # ---- forward --------------------------------------------------------------------------

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """Within the context no model parameter collects gradients (only the writes train)."""
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        for p in trainable:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in trainable:
                p.requires_grad_(True)

    def _autocast(self):
        return in_precision(self.model, self.precision)

    @contextlib.contextmanager
    def _upper_layers(self) -> Iterator[None]:
        """The stack cut to the layers above L, their attention renumbered from 0 (their index in a cache)."""
        full = getattr(self.stack, self.layers_attr)
        upper = list(full)[self.layer + 1 :]
        attentions = [a for a in (getattr(m, "self_attn", None) for m in upper) if hasattr(a, "layer_idx")]
        numbers = [a.layer_idx for a in attentions]
        setattr(self.stack, self.layers_attr, nn.ModuleList(upper))
        for j, a in enumerate(attentions):
            a.layer_idx = j
        try:
            yield
        finally:
            setattr(self.stack, self.layers_attr, full)
            for a, number in zip(attentions, numbers):
                a.layer_idx = number

    def logits(self, rows: Sequence[int], residual: torch.Tensor) -> torch.Tensor:
        """Logits at the last ``max target length + 1`` positions with ``residual`` (B, W, d_out)
        added to the edited down-projection's output."""
        # A contiguous slice for the vocabulary GEMM: a strided one runs far slower on CPU.
        return self.model.get_output_embeddings()(self._last_hidden(rows, residual).contiguous())

    def _last_hidden(self, rows: Sequence[int], residual: torch.Tensor) -> torch.Tensor:
        """The final hidden states (B, max target length + 1, d) behind :meth:`logits`."""
        batch = [self.seqs[i] for i in rows]
        keep = max(self.target_lens[i] for i in rows) + 1
        inputs = batch_inputs(batch, self.pid, self.device)
        with self._autocast():
            if self.upper_only:
                out = self._upper_pass(rows, inputs, residual)
            else:
                handle = self.site.module.register_forward_hook(lambda m, a, o: o + residual.to(o.dtype))
                try:
                    out = self.model.base_model(**inputs, use_cache=False).last_hidden_state
                finally:
                    handle.remove()
        return out[:, -keep:]

    def _upper_pass(self, rows: Sequence[int], inputs: dict[str, torch.Tensor], residual: torch.Tensor) -> torch.Tensor:
        """Last hidden states (B, Ws, d) of the positions after each row's cached prefix (left-padded)."""
        W = inputs["input_ids"].shape[1]
        splits = [self.split[i] for i in rows]
        rests = [len(self.seqs[i]) - s for i, s in zip(rows, splits)]
        wp, ws = max(splits), max(rests)
        first = self.hidden[rows[0]]
        hidden = torch.zeros(len(rows), ws, first.shape[-1], device=self.device, dtype=first.dtype)
        add = torch.zeros(len(rows), ws, residual.shape[-1], device=self.device, dtype=residual.dtype)
        mask = torch.zeros(len(rows), wp + ws, dtype=torch.long, device=self.device)
        positions = torch.zeros(len(rows), ws, dtype=torch.long, device=self.device)
        for b, (i, s, r) in enumerate(zip(rows, splits, rests)):
            hidden[b, ws - r :] = self.hidden[i][s:].to(self.device)
            add[b, ws - r :] = residual[b, W - r :]
            mask[b, wp - s : wp] = 1
            mask[b, wp + ws - r :] = 1
            positions[b, ws - r :] = torch.arange(s, s + r, device=self.device)
        cache = left_padded_cache([self.prefix_kv[i] if s else [] for i, s in zip(rows, splits)], wp, self.device) if wp else None
        with self._upper_layers():
            return self.stack(
                inputs_embeds=hidden + add.to(hidden.dtype),
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=cache is not None,
            ).last_hidden_state

    def nll(self, rows: Sequence[int], residual: torch.Tensor) -> torch.Tensor:
        """(B,) mean NLL of each row's target tokens."""
        return self.scored(rows, residual)[0]

    def scored(self, rows: Sequence[int], residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(nll, exact)``: (B,) mean NLL of each row's target tokens and whether every one of
        them is the argmax given the ones before (what greedy decoding of the target needs)."""
        hidden = self._last_hidden(rows, residual)
        K = hidden.shape[1]
        lengths = torch.tensor([self.target_lens[i] for i in rows])
        row = torch.repeat_interleave(torch.arange(len(rows)), lengths)
        # logits at position p predict token p+1: the last n tokens come from the n positions before them
        at = torch.cat([torch.arange(K - n - 1, K - 1) for n in lengths.tolist()])
        target = torch.tensor([t for i in rows for t in self.seqs[i][-self.target_lens[i] :]], device=hidden.device)
        # the vocabulary GEMM only where a target token is predicted, and one gather for the whole batch
        logits = self.model.get_output_embeddings()(hidden[row.to(hidden.device), at.to(hidden.device)]).float()
        token_nll = F.cross_entropy(logits, target, reduction="none")
        row = row.to(hidden.device)
        nll = torch.zeros(len(rows), device=hidden.device).index_add(0, row, token_nll) / lengths.to(hidden.device)
        missed = torch.zeros(len(rows), device=hidden.device).index_add(0, row, (logits.detach().argmax(-1) != target).float())
        return nll, (missed == 0).cpu()


def edited_forward(
    model,
    tokenizer,
    seqs: Sequence[Sequence[int]],
    target_lens: Sequence[int],
    owners: Sequence[int],
    op: AloeOperator,
    cfg: BuildConfig,
    held: Sequence[int] | None = None,
) -> EditedForward:
    """The shared forward of stages 6 and 8 (gates depend only on V, tau, alpha, fixed by then).
    Sequence i < op.n is slot i's request; later ones are extra sequences of slot ``owners[i]``;
    only the ``held`` ones are run (default: all)."""
    return EditedForward(
        model,
        tokenizer,
        seqs,
        target_lens,
        op,
        cfg.batch_size,
        cfg.compute_dtype,
        desc="stages 6-8: gates and layer outputs",
        owners=owners,
        held=held,
    )
