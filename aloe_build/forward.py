"""Batched forward passes over token sequences: teacher-forced scoring and greedy generation.

Both construction (which target tokens the unedited model already predicts,
what it writes after a prompt) and evaluation use them, with the padding
convention of :mod:`aloe_build.tokens`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import warnings
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

import torch
from torch import nn

from aloe_kernels.hf import locate_down_proj, written_from
from aloe_kernels.reading import gate_input
from aloe_kernels.reference import normalize_rows
from aloe_kernels.screened import fast_bf16_cpu

from .tokens import left_pad

#: What a long pass calls after each batch with the number of items it finished (an outer progress bar).
Tick = Callable[[int], None]


class SlotEditor(Protocol):
    """What :func:`teacher_forced` needs of an editor to report slot activations."""

    layer: int | None

    @property
    def has_slots(self) -> bool: ...

    def slot_activations(self, h: torch.Tensor) -> torch.Tensor | None: ...


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without parameters)."""
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


#: The precisions a build may run forward passes in ("float32": the model's own dtype).
PASS_DTYPES = {"float32": None, "bfloat16": torch.bfloat16}


def autocast_dtype(name: str) -> torch.dtype | None:
    """The autocast dtype of a build precision name (None: no autocast)."""
    if name not in PASS_DTYPES:
        raise ValueError(f"unknown pass precision {name!r}; use one of {', '.join(PASS_DTYPES)}")
    return PASS_DTYPES[name]


def in_precision(model: nn.Module, name: str) -> contextlib.AbstractContextManager:
    """A context that runs the model's forward passes in precision ``name`` (autocast for bfloat16).

    Warns when bfloat16 is asked for on a CPU without AMX or AVX512-BF16, which only emulates it
    (:func:`aloe_kernels.screened.fast_bf16_cpu`): there such passes are several
    times slower than float32 (docs/results.md, "Each edit's negatives in bfloat16")."""
    dtype = autocast_dtype(name)
    if dtype is None:
        return contextlib.nullcontext()
    device = model_device(model)
    if device.type == "cpu" and dtype == torch.bfloat16 and not fast_bf16_cpu():
        warnings.warn(
            "this CPU has no bfloat16 instructions: bfloat16 passes are emulated and several times "
            "slower than float32; set this precision to float32 here",
            RuntimeWarning,
            stacklevel=2,
        )
    return torch.autocast(device.type, dtype=dtype)


def batches(order: list[int], size: int) -> Iterable[list[int]]:
    """Consecutive chunks of ``order`` of at most ``size`` items."""
    for i in range(0, len(order), size):
        yield order[i : i + size]


def progress_bar(total: int, desc: str, progress: bool):
    """A tqdm bar on stderr, disabled unless ``progress``."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not progress, leave=False, file=sys.stderr, dynamic_ncols=True)


@dataclasses.dataclass
class TFResult:
    """What one teacher-forced pass gives for one (prompt, continuation) sequence."""

    preds: tuple[int, ...]  # argmax predictions for each continuation token
    nll: float  # mean negative log-likelihood of the continuation
    hidden: torch.Tensor | None = None  # final hidden state at the last prompt token
    gate_idx: torch.Tensor | None = None  # nonzero slot indices at the last prompt token
    gate_val: torch.Tensor | None = None  # their activations
    prompt_max_gate: float | None = None  # max over prompt tokens and slots
    prompt_max_slot: int | None = None
    states: torch.Tensor | None = None  # normalized states (k, d) at the positions predicting the continuation

    def gate(self, slot: int | None) -> float:
        if slot is None or self.gate_idx is None:
            return 0.0
        hit = (self.gate_idx == slot).nonzero()
        return float(self.gate_val[hit[0, 0]]) if hit.numel() else 0.0

    def top(self) -> tuple[int | None, float]:
        if self.gate_val is None or self.gate_val.numel() == 0:
            return None, 0.0
        j = int(self.gate_val.argmax())
        return int(self.gate_idx[j]), float(self.gate_val[j])


def teacher_forced(
    model: nn.Module,
    seqs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    pad_id: int,
    batch_size: int = 32,
    editor: SlotEditor | None = None,
    hidden: Sequence[bool] | bool = False,
    states_layer: int | None = None,
    progress: bool = False,
    desc: str = "teacher-forced",
    tick: Tick | None = None,
) -> list[TFResult]:
    """One teacher-forced forward over each ``(prompt_ids, continuation_ids)``.

    Returns, per sequence, the argmax prediction and NLL for every
    continuation token; the final hidden state at the last prompt token when
    ``hidden`` asks for it; and, when ``editor`` has slots, the nonzero slot
    activations at the last prompt token and the maximum over all prompt
    tokens; with ``states_layer``, the normalized inputs of that layer's
    down-projection at the positions that predict the continuation tokens (the
    last prompt token onwards). Sequences are sorted by length and left-padded; only the logits
    of the last ``max(k) + 1`` positions are computed. ``tick``, if given, is called after
    each batch with the number of sequences it finished (an outer progress bar).
    """
    n = len(seqs)
    out: list[TFResult | None] = [None] * n
    if n == 0:
        return []
    want_hidden = [bool(hidden)] * n if isinstance(hidden, bool) else [bool(x) for x in hidden]
    device = model_device(model)
    order = sorted(range(n), key=lambda i: (len(seqs[i][0]) + len(seqs[i][1]), i))
    slots = editor is not None and editor.has_slots
    state: dict[str, Any] = {}
    # the inputs of the output head ("final"), of the editor's layer ("h") and of states_layer ("states")
    handles = [_keep_input(model.get_output_embeddings(), state, "final")]
    if slots:
        handles.append(_keep_read_input(model, editor.layer, state, "h"))
    if states_layer is not None:
        handles.append(_keep_read_input(model, states_layer, state, "states"))
    bar = progress_bar(n, desc, progress)
    try:
        with torch.inference_mode():
            for batch in batches(order, batch_size):
                full = [list(seqs[i][0]) + list(seqs[i][1]) for i in batch]
                ks = [len(seqs[i][1]) for i in batch]
                kmax = max(ks)
                ids, mask, pos = left_pad(full, pad_id, device)
                T = ids.shape[1]
                state.clear()
                # an operator writes from each row's last prompt token on, as it would when generating
                with written_from(model, torch.tensor([T - 1 - k for k in ks], device=device)):
                    res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, logits_to_keep=kmax + 1)
                logp = torch.log_softmax(res.logits[:, -(kmax + 1) :].float(), dim=-1)  # (B, kmax+1, V)
                final = state.get("final")
                if final is not None:
                    final = final[:, -(kmax + 1) :]
                acts = editor.slot_activations(state["h"]) if slots else None  # (B, T, n)
                for b, i in enumerate(batch):
                    r = _tf_row(logp[b], seqs[i][1], kmax)
                    if want_hidden[i] and final is not None:
                        r.hidden = final[b, kmax - len(seqs[i][1])].float().cpu().clone()
                    if acts is not None:
                        _add_gates(r, acts[b], T - 1 - len(seqs[i][1]), T - len(full[b]))
                    if states_layer is not None:
                        r.states = normalize_rows(state["states"][b, T - 1 - len(seqs[i][1]) : T - 1]).cpu()
                    out[i] = r
                bar.update(len(batch))
                if tick is not None:
                    tick(len(batch))
    finally:
        bar.close()
        for h in handles:
            h.remove()
    return out  # type: ignore[return-value]


def _keep_input(module: nn.Module, box: dict[str, Any], key: str):
    """Keeps the input of every call of ``module`` in ``box[key]``; returns the hook's handle."""
    return module.register_forward_hook(lambda _m, args, _o: box.__setitem__(key, args[0].detach()))


def _keep_read_input(model: nn.Module, layer: int, box: dict[str, Any], key: str):
    """:func:`_keep_input` of layer ``layer``'s down-projection, as its gates read it (the running
    reading where the model tracks one, :mod:`aloe_kernels.reading`)."""

    def keep(_m, args, _o):
        box[key] = gate_input(model, args[0])

    return locate_down_proj(model, layer).module.register_forward_hook(keep)


def _tf_row(logp: torch.Tensor, cont_ids: Sequence[int], kmax: int) -> TFResult:
    """Argmax predictions and mean NLL of one row's continuation from the last ``kmax + 1`` log-probabilities."""
    k = len(cont_ids)
    lp = logp[kmax - k : kmax]
    cont = torch.tensor(cont_ids, device=lp.device)
    return TFResult(preds=tuple(int(x) for x in lp.argmax(-1).tolist()), nll=float(-lp.gather(1, cont[:, None]).mean()))


def _add_gates(r: TFResult, acts: torch.Tensor, last: int, first: int) -> None:
    """Slot activations of one row (T, n): the nonzero ones at the last prompt token ``last``
    and the maximum over the prompt tokens ``first..last``."""
    a_last = acts[last]
    nz = a_last.nonzero().flatten()
    r.gate_idx = nz.cpu()
    r.gate_val = a_last[nz].cpu()
    span = acts[first : last + 1]
    if span.numel():
        flat = span.max(0).values
        j = int(flat.argmax())
        r.prompt_max_gate = float(flat[j])
        r.prompt_max_slot = j if r.prompt_max_gate > 0 else None
    else:
        r.prompt_max_gate, r.prompt_max_slot = 0.0, None


class StopForward(Exception):
    """Raised by a capture hook to skip the layers above the edited one."""


@contextlib.contextmanager
def capture_down_proj_input(model: nn.Module, layer: int, stop: bool = True, raw: bool = False) -> Iterator[dict]:
    """Within the context, every forward stores the down-projection input under ``box["h"]`` (where the
    model tracks a running reading, :mod:`aloe_kernels.reading`, the reading: what the gates see).

    While ``box["stop"]`` (``stop`` at first; a caller may change it between passes) the forward
    is cut right after the capture (use :func:`aloe_build.states.run_captured`). ``raw``: the input
    itself even where the model tracks a reading (a caller that computes the reading its own way).
    """
    site = locate_down_proj(model, layer)
    box: dict = {"stop": stop}

    def hook(module, args):
        box["h"] = args[0].detach() if raw else gate_input(model, args[0])
        if box["stop"]:
            raise StopForward

    handle = site.module.register_forward_pre_hook(hook)
    try:
        yield box
    finally:
        handle.remove()


def greedy_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    lengths: Sequence[int] | int,
    *,
    pad_id: int,
    batch_size: int = 32,
    progress: bool = False,
    desc: str = "generate",
    tick: Tick | None = None,
) -> list[list[int]]:
    """Greedy generation of exactly ``lengths[i]`` tokens after each prompt (token ids).

    Batched with left padding and a KV cache; position ids follow the
    attention mask as in ``model.generate``. Generation does not stop at EOS
    (the caller decides what a generated EOS means); each batch stops after
    its longest requested length. ``tick`` as in :func:`teacher_forced`.
    """
    return _generate(model, prompts, lengths, pad_id, batch_size, progress, desc, tick)[0]


def generate_with_states(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    lengths: Sequence[int] | int,
    layer: int,
    *,
    starts: Sequence[int] | None = None,
    pad_id: int,
    batch_size: int = 32,
    tick: Tick | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """:func:`greedy_generate`, and the normalized inputs of layer ``layer``'s down-projection
    along each prompt and its generation, from position ``starts[i]`` (default: the first
    generated token) to the last generated token: ``(tokens, states)``, ``states[i]`` of shape
    ``(len(prompts[i]) + lengths[i] - starts[i], d)``.

    The states are those the generation passes through anyway (a state depends only on the tokens
    up to its own), so no second pass over the generated sequences is needed; the last generated
    token is fed once more, up to the edited layer only."""
    starts = [len(p) for p in prompts] if starts is None else [int(x) for x in starts]
    if len(starts) != len(prompts) or any(not 0 <= s <= len(p) for s, p in zip(starts, prompts)):
        raise ValueError("starts must give, for each prompt, a position within it or just past its end")
    return _generate(model, prompts, lengths, pad_id, batch_size, False, "generate", tick, (layer, starts))


def _generate(
    model,
    prompts,
    lengths,
    pad_id: int,
    batch_size: int,
    progress: bool,
    desc: str,
    tick: Tick | None,
    capture: tuple[int, list[int]] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy generation; with ``capture = (layer, starts)`` also the states of :func:`generate_with_states`."""
    n = len(prompts)
    ks = [int(lengths)] * n if isinstance(lengths, int) else [int(x) for x in lengths]
    if len(ks) != n or any(k < 0 for k in ks):
        raise ValueError("lengths must give a number >= 0 of tokens for each prompt")
    out: list[list[int]] = [[] for _ in range(n)]
    states: list[torch.Tensor] = []
    if n == 0:
        return out, states
    device = model_device(model)
    order = sorted(range(n), key=lambda i: (ks[i], len(prompts[i]), i))
    if capture is not None:
        states = [torch.empty(0, locate_down_proj(model, capture[0]).d)] * n
    # the forward pre-hook of the edited down-projection, when states are asked for
    capturing = contextlib.nullcontext({}) if capture is None else capture_down_proj_input(model, capture[0], stop=False)
    bar = progress_bar(n, desc, progress)
    try:
        with torch.inference_mode(), capturing as box:
            for batch in batches(order, batch_size):
                kmax = max(ks[i] for i in batch)
                if kmax <= 0 and capture is None:
                    bar.update(len(batch))
                    continue
                ids, mask, pos = left_pad([prompts[i] for i in batch], pad_id, device)
                box["stop"] = kmax <= 0  # states of the prompts only: the logits are not needed
                res = run_until_stopped(
                    model, input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1
                )
                captured = [box.get("h")]  # (B, P, d), then (B, 1, d) per fed token
                steps: list[torch.Tensor] = []
                for step in range(kmax):
                    nxt = res.logits[:, -1].argmax(-1)
                    steps.append(nxt)
                    if step + 1 == kmax and capture is None:
                        break
                    # the last generated token is fed only for its state, up to the edited layer
                    box["stop"] = step + 1 == kmax
                    res, mask, pos = feed_tokens(model, nxt, mask, pos, res.past_key_values)
                    captured.append(box.get("h"))
                if steps:
                    gen = torch.stack(steps, dim=1).cpu()
                    for b, i in enumerate(batch):
                        out[i] = [int(x) for x in gen[b, : ks[i]].tolist()]
                if capture is not None:
                    h = torch.cat(captured, dim=1)  # (B, P + kmax, d), the prompts right-aligned in P
                    width = ids.shape[1]
                    for b, i in enumerate(batch):
                        lo = width - len(prompts[i]) + capture[1][i]
                        states[i] = normalize_rows(h[b, lo : width + ks[i]]).cpu()
                bar.update(len(batch))
                if tick is not None:
                    tick(len(batch))
    finally:
        bar.close()
    return out, states


def feed_tokens(model: nn.Module, tokens: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, past):
    """One decoding step: ``tokens`` (B,) after the cached ``past``, whose attention mask and last
    position ids are ``mask`` and ``pos``; returns ``(output or None, mask, pos)`` extended by the step
    (the output None where a capture hook cut the pass short)."""
    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
    pos = pos[:, -1:] + 1
    res = run_until_stopped(
        model,
        input_ids=tokens[:, None],
        attention_mask=mask,
        position_ids=pos,
        past_key_values=past,
        use_cache=True,
        logits_to_keep=1,
    )
    return res, mask, pos


def run_until_stopped(model: nn.Module, **inputs):
    """A forward pass that a capture hook may cut short (:class:`StopForward`): then returns None."""
    try:
        return model(**inputs)
    except StopForward:
        return None


# =============================================================================
# Queries
# =============================================================================
