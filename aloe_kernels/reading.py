"""What an operator's gates read: the state at the current token, or a running mean of the states so far.

The last token of a prompt carries little of which fact is asked; the text of the question does. A
*running reading* gives the gates the exponentially weighted sum of the unit states of every token so
far, each earlier token weighing ``decay`` times the one after it::

    r_t = decay * r_{t-1} + h_t / max(|h_t|, eps)

so the question just asked dominates and text further back fades, with no span to find and one
vector per sequence to carry from one forward call to the next. ``decay = 0`` is the plain
last-token reading (the gate normalizes its input, so ``r_t`` and ``h_t`` give the same gate).

A :class:`ReadingTracker` hooks the top-level model to learn, per forward call, which positions are
padding (from the attention mask) and whether the call continues the previous one through a KV cache;
the edited layer then reads its input through :meth:`ReadingTracker.read`. Rows keep their order from
one call to the next (greedy and sampled generation; beam search, which reorders rows, is not
supported).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .errors import PatchError
from .reference import compute_dtype

#: tokens per block of the closed form: decay ** -(block - 1) must stay well inside float32
_BLOCK = 32
#: the smallest norm a state is divided by (a zero state stays zero)
READING_EPS = 1e-6


def check_decay(decay: float) -> float:
    """``decay`` as a float in [0, 1), else a ValueError."""
    decay = float(decay)
    if not 0.0 <= decay < 1.0:
        raise ValueError(f"reading decay must be in [0, 1), got {decay}")
    return decay


def unit_rows(h: torch.Tensor, eps: float = READING_EPS, squared_norms: torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``h`` over ``max(|row|, eps)`` in the compute dtype (zero rows stay zero).

    ``squared_norms`` (..., 1): the rows' squared norms where ``h`` holds only part of each row's
    coordinates (a tensor-parallel shard, its norms summed over the shards); default: ``h``'s own."""
    u = h.to(compute_dtype(h.dtype))
    norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True) if squared_norms is None else squared_norms.to(u.dtype).sqrt()
    return u / norm.clamp_min(eps)


def running_unit_sum(
    h: torch.Tensor,
    decay: float,
    valid: torch.Tensor | None = None,
    carry: torch.Tensor | None = None,
    eps: float = READING_EPS,
) -> torch.Tensor:
    """``r`` of shape (B, T, d) in float32 (float64 for float64 ``h``): ``r_t = decay r_{t-1} + unit(h_t)``.

    ``valid`` (B, T) marks the positions that count (padding does not: its unit state is taken as zero);
    ``carry`` (B, d) is ``r`` just before the first position (the last reading of the previous call).
    """
    return running_sum(unit_rows(h, eps), decay, valid, carry)


def running_sum(
    u: torch.Tensor, decay: float, valid: torch.Tensor | None = None, carry: torch.Tensor | None = None
) -> torch.Tensor:
    """:func:`running_unit_sum` of rows already made unit (:func:`unit_rows`), ``u`` (B, T, d) in the
    compute dtype. Computed in blocks of :data:`_BLOCK` tokens, each a small lower-triangular product."""
    ct = u.dtype
    if valid is not None:
        u = u * valid.to(device=u.device, dtype=ct).unsqueeze(-1)
    if decay == 0.0:
        return u
    B, T, d = u.shape
    out = torch.empty_like(u)
    prev = torch.zeros(B, d, dtype=ct, device=u.device) if carry is None else carry.to(device=u.device, dtype=ct)
    steps = torch.arange(_BLOCK, device=u.device, dtype=ct)
    lag = steps[:, None] - steps[None, :]
    weights = torch.where(lag >= 0, decay ** lag.clamp_min(0), torch.zeros((), dtype=ct, device=u.device))
    for lo in range(0, T, _BLOCK):
        L = min(_BLOCK, T - lo)
        block = weights[:L, :L] @ u[:, lo : lo + L] + (decay ** (steps[:L] + 1))[None, :, None] * prev[:, None, :]
        out[:, lo : lo + L] = block
        prev = block[:, -1]
    return out


def tree_running_sum(
    h: torch.Tensor, parent: Sequence[int], depth: Sequence[int], decay: float, eps: float = READING_EPS
) -> torch.Tensor:
    """:func:`running_unit_sum` over a token tree (nodes in a row, ``h`` (N, d)): each node's reading
    continues its parent's (``parent[k]`` = -1 for a first token), as a sequence through that node
    would have it. Nodes are taken depth by depth."""
    u = unit_rows(h, eps)
    out = u.clone()
    par = torch.as_tensor(list(parent), dtype=torch.long, device=h.device)
    dep = torch.as_tensor(list(depth), dtype=torch.long, device=h.device)
    for d in range(1, int(dep.max()) + 1 if dep.numel() else 0):
        at = (dep == d).nonzero().squeeze(1)
        out[at] = u[at] + decay * out[par[at]]
    return out


class ReadingTracker:
    """The running reading of one model: padding and cache continuity per forward call, and the last
    reading of every row to carry into the next call."""

    def __init__(self, model: nn.Module, decay: float):
        self.decay = check_decay(decay)
        self.users = 1
        self._valid: torch.Tensor | None = None
        self._continues = False
        self._carry: torch.Tensor | None = None
        self._call = 0
        self._read: tuple[int, torch.Tensor] | None = None
        self._handle = model.register_forward_pre_hook(self._on_forward, with_kwargs=True)

    def _on_forward(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        embeds = kwargs.get("inputs_embeds")
        tokens = ids if ids is not None else embeds
        mask = kwargs.get("attention_mask")
        cache = kwargs.get("past_key_values")
        self._continues = cache is not None and _cache_length(cache) > 0
        self._valid = None
        if mask is not None and tokens is not None and mask.dim() == 2:
            self._valid = mask[:, -tokens.shape[1] :].bool()
        self._call += 1

    def read(self, h: torch.Tensor) -> torch.Tensor:
        """The reading at every position of ``h`` (B, T, d) in ``h``'s dtype; once per forward call (a
        second read in the same call returns the first)."""
        if self._read is not None and self._read[0] == self._call:
            return self._read[1]
        rows = h if h.dim() == 3 else h.unsqueeze(0)
        carry = self._carry if self._continues and self._carry is not None and self._carry.shape[0] == rows.shape[0] else None
        valid = self._valid if self._valid is not None and tuple(self._valid.shape) == tuple(rows.shape[:2]) else None
        r = running_unit_sum(rows.detach(), self.decay, valid, carry)
        self._carry = r[:, -1].detach()
        out = r.to(h.dtype).reshape(h.shape)
        self._read = (self._call, out)
        return out

    def close(self) -> None:
        self._handle.remove()


def _cache_length(cache: Any) -> int:
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    try:  # legacy tuple of (key, value) per layer
        return int(cache[0][0].shape[-2])
    except (TypeError, IndexError, AttributeError):
        return 0


_ATTR = "_aloe_reading"


def attach_reading(model: nn.Module, decay: float) -> ReadingTracker | None:
    """Make ``model`` track the running reading of ``decay`` (None for 0: the plain reading needs no
    tracking). Attaching the same decay again shares the tracker (:func:`detach_reading` once per
    attach); another decay while one is attached is refused."""
    decay = check_decay(decay)
    found = reading_of(model)
    if found is not None:
        if found.decay != decay:
            raise PatchError(f"the model already tracks a running reading of decay {found.decay}, not {decay}")
        found.users += 1
        return found
    if decay == 0.0:
        return None
    tracker = ReadingTracker(model, decay)
    object.__setattr__(model, _ATTR, tracker)
    return tracker


def detach_reading(model: nn.Module) -> None:
    """Undo one :func:`attach_reading` (the hook goes with the last)."""
    tracker = reading_of(model)
    if tracker is None:
        return
    tracker.users -= 1
    if tracker.users <= 0:
        tracker.close()
        object.__delattr__(model, _ATTR)


@contextlib.contextmanager
def reading_tracked(model: nn.Module, decay: float) -> Iterator[ReadingTracker | None]:
    """:func:`attach_reading` for the duration of the context."""
    tracker = attach_reading(model, decay)
    try:
        yield tracker
    finally:
        detach_reading(model)


def gate_input(model: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """What the gates of an operator on ``model`` read of the down-projection input ``h``: the running
    reading where the model tracks one, else ``h`` itself (detached)."""
    tracker = reading_of(model)
    return h.detach() if tracker is None else tracker.read(h)


def reading_of(model: nn.Module) -> ReadingTracker | None:
    """The running reading ``model`` tracks, if any."""
    return model.__dict__.get(_ATTR)
