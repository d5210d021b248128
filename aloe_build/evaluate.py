"""Evaluation of knowledge editors: the paper's protocol, EasyEdit's numbers, and gate diagnostics.

One call scores one or more *editors* (ALOE, the unedited model, the GRACE
reimplementation) on the same model, layer and edit stream, after the whole
stream is in (the paper's protocol: one operator for the whole stream).

Two metric families are reported side by side and never mixed in one number.

Paper protocol (greedy-generation exact match)
    ``efficacy``
        For an edit with prompt ``p`` and target ``t``: the target tokens are
        the continuation tokens of ``p + " " + t`` tokenized as one string
        (the tokens that follow the prompt's own tokens; if the tokenizer
        merges across the boundary, ``" " + t`` is tokenized on its own). The
        model generates exactly that many tokens greedily after ``p``; the
        edit counts as a hit when the decoded generation, stripped, equals
        ``t`` stripped. Greedy generation produces the target tokens exactly
        when the teacher-forced argmax is right at every target position, so
        a row whose teacher-forced predictions are all correct is a hit
        without generating again; every other row is generated for real and
        compared as strings (which also accepts a different tokenization of
        the same text). Mean over edits.
    ``generalization``
        The same exact match on each rephrase of the request; mean over an
        edit's rephrases, then over the edits that have rephrases (``None``
        when no edit has one, e.g. KnowEdit WikiData_recent).
    ``locality``
        Exact-generation stability relative to the unedited model. For each
        locality prompt, the unedited model generates ``k`` tokens greedily
        (``k`` = the continuation-token length of its first ground-truth
        answer, clipped to ``[1, 16]``; 8 when the data gives none). The
        prompt counts as stable when the edited model, teacher-forced on that
        same continuation, predicts at every one of the ``k`` positions the
        token the unedited model predicts there, i.e. the edited model's
        greedy generation is token for token the unedited one's. (Comparing
        argmaxes of the two models on one shared forward layout makes the
        unedited model score exactly 1.0, free of batch-layout float noise.)
        Mean over an edit's locality prompts, then over edits that have any.
    ``portability``
        Exact match of a greedy generation to any accepted answer of each
        portability prompt (per answer: as many tokens as that answer has);
        mean per edit, then over edits that have portability prompts; also
        by kind (reasoning, subject_aliasing, ...).

EasyEdit teacher-forced token accuracy (labelled ``easyedit`` in the report)
    Follows EasyEdit's ``test_prediction_acc`` / ``compute_locality_quality``:
    ``rewrite_acc`` = share of the target tokens of ``p + " " + t`` whose
    teacher-forced argmax is right (mean over edits); ``rephrase_acc`` = the
    same on rephrases (mean over an edit's rephrases, then over edits);
    ``locality`` = share of positions of ``prompt + " " + ground_truth[0]``
    where the edited model's teacher-forced argmax equals the unedited
    model's (per prompt, then per edit, then over edits; kinds averaged the
    same way); ``portability`` = teacher-forced token accuracy on
    ``prompt + " " + ground_truth[0]``. First alias only, as EasyEdit does.

Mechanism diagnostics (editors with slots: ALOE gates, GRACE codebook hits)
    The down-projection input ``h`` at the edited layer is captured by a
    forward hook during the teacher-forced pass; ALOE's gates are
    ``aloe_gates(h, op)``; GRACE's "gate" is 1 for the nearest key when it is
    within its deferral radius and 0 elsewhere.

    * matched gate: the gate of the edit's own slot at the last prompt token
      of the request (or rephrase). The own slot is the operator row whose
      metadata ``id`` (or one of its ``ids``, for a slot shared by identical
      edits) equals the request's id, else the row with the same request
      text and target.
    * the matched slot *dominates* when its gate is > 0 and is the largest of
      all slots at that position.
    * locality max gate: the largest gate over all slots and over every
      prompt token of a locality prompt.
    * the gate is *open* when it is >= ``open_threshold`` (0.5).
    * a missed request (or rephrase) is an *address failure* when its
      matched gate is not open, and a *write failure* when the gate was open
      and the generation was still wrong.
    * locality drift: ``|s_edit - s_ref| / |s_ref|`` of the final hidden
      state (the input of the LM head) at the last prompt token; next-token
      agreement: the argmax next token there is the same. Reported for every
      editor, slot-based or not.

Entry points: :func:`evaluate` (API) and ``aloe eval`` (registered by
:func:`add_eval_cli`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import hashlib
import json
import math
import os
import platform
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

__all__ = [
    "AloeEditor",
    "Editor",
    "EditorResult",
    "EvalReport",
    "METRIC_DEFINITIONS",
    "UneditedEditor",
    "add_eval_cli",
    "encode_continuation",
    "evaluate",
    "exact_match",
    "greedy_generate",
    "relative_drift",
    "teacher_forced",
    "token_accuracy",
]

SCHEMA = "aloe-eval/1"
LOCALITY_MAX_TOKENS = 16
LOCALITY_DEFAULT_TOKENS = 8
PORTABILITY_MAX_TOKENS = 16

METRIC_DEFINITIONS: dict[str, str] = {
    "paper.efficacy": "greedy generation of len(target tokens) tokens after the request; hit when the decoded "
    "generation, stripped, equals target_new (target tokens = continuation tokens of prompt + ' ' + target); "
    "a row whose teacher-forced argmax is right at every target position is a hit (identical greedy output); "
    "mean over edits",
    "paper.generalization": "the same exact match on each rephrase; mean over an edit's rephrases, then over edits "
    "with rephrases",
    "paper.locality": "share of locality prompts whose greedy generation of k tokens (k = tokens of the first "
    "ground truth, clipped to [1, 16]; 8 without one) is token-for-token unchanged from the unedited model's; mean "
    "per edit, then over edits",
    "paper.portability": "exact match of the greedy generation to any accepted answer; mean per edit, then over edits",
    "easyedit.rewrite_acc": "EasyEdit teacher-forced token accuracy on prompt + ' ' + target_new",
    "easyedit.rephrase_acc": "EasyEdit teacher-forced token accuracy on rephrase + ' ' + target_new",
    "easyedit.locality": "EasyEdit: share of positions of prompt + ' ' + ground_truth[0] where the edited model's "
    "teacher-forced argmax equals the unedited model's",
    "easyedit.portability": "EasyEdit teacher-forced token accuracy on prompt + ' ' + ground_truth[0]",
    "diagnostics.matched_gate": "gate of the edit's own slot at the last prompt token",
    "diagnostics.dominates": "own slot's gate > 0 and largest of all slots at the last prompt token",
    "diagnostics.locality_max_gate": "largest gate over all slots and all prompt tokens of a locality prompt",
    "diagnostics.open": "gate >= open_threshold",
    "diagnostics.address_failure": "a miss whose matched gate is not open",
    "diagnostics.write_failure": "a miss whose matched gate is open",
    "locality_states.drift": "|s_edit - s_unedited| / |s_unedited| of the final hidden state (LM-head input) at the "
    "last prompt token of a locality prompt",
    "locality_states.next_token_agreement": "share of locality prompts whose argmax next token is unchanged",
}


# =============================================================================
# Editors
# =============================================================================


class Editor:
    """Something that edits a model in place for evaluation, and can be undone.

    Subclasses set ``name`` and ``layer`` and implement :meth:`attach` and
    :meth:`detach`. Slot-based editors also implement :meth:`slot_activations`
    (activations of every slot for down-projection inputs ``h``, shape
    ``(..., n_slots)``, in [0, 1]) and :meth:`slot_of` (the slot of a request).
    """

    name: str = "editor"
    layer: int | None = None

    def attach(self, model: nn.Module) -> None:
        raise NotImplementedError

    def detach(self, model: nn.Module) -> None:
        raise NotImplementedError

    @property
    def has_slots(self) -> bool:
        return False

    def slot_activations(self, h: torch.Tensor) -> torch.Tensor | None:
        return None

    def slot_of(self, request: Any, index: int) -> int | None:
        return None

    def info(self) -> dict[str, Any]:
        return {}


class UneditedEditor(Editor):
    """The model as it is: its numbers are the unedited baseline."""

    name = "unedited"

    def __init__(self, layer: int | None = None):
        self.layer = layer

    def attach(self, model: nn.Module) -> None:
        pass

    def detach(self, model: nn.Module) -> None:
        pass


class AloeEditor(Editor):
    """An ALOE operator patched into the model with :func:`aloe_kernels.apply_aloe`."""

    def __init__(self, op, name: str = "ALOE", check_fingerprint: bool = True, layer: int | None = None):
        from aloe_kernels import AloeOperator

        if not isinstance(op, AloeOperator):
            raise TypeError(f"AloeEditor needs an AloeOperator, got {type(op).__name__}")
        self.op = op
        self.name = name
        self.check_fingerprint = check_fingerprint
        self.layer = op.layer if layer is None else layer
        if self.layer is None:
            raise ValueError("the operator records no layer; pass layer=")
        self._by_id: dict[str, int] = {}
        for i, e in enumerate(op.edits):  # a slot shared by identical edits lists them all under "ids"
            for rid in [e.get("id"), *(e.get("ids") or [])]:
                if rid is not None:
                    self._by_id.setdefault(str(rid), i)
        self._by_text: dict[tuple[str, str], int] = {}
        for i, e in enumerate(op.edits):
            key = (str(e.get("request") or "").strip(), str(e.get("target") or "").strip())
            if key[0] and key not in self._by_text:
                self._by_text[key] = i
        self._gate_op = op.to("cpu", torch.float64 if op.dtype == torch.float64 else torch.float32)

    def attach(self, model: nn.Module) -> None:
        from aloe_kernels import apply_aloe

        apply_aloe(model, self.op, layer=self.layer, check_fingerprint=self.check_fingerprint)

    def detach(self, model: nn.Module) -> None:
        from aloe_kernels import remove_aloe

        remove_aloe(model)

    @property
    def has_slots(self) -> bool:
        return True

    def slot_activations(self, h: torch.Tensor) -> torch.Tensor:
        from aloe_kernels import aloe_gates

        op = self._gate_op
        if op.device != h.device:
            self._gate_op = op = op.to(h.device)
        return aloe_gates(h, op).float()

    def slot_of(self, request: Any, index: int) -> int | None:
        rid = getattr(request, "id", None)
        if rid is not None and str(rid) in self._by_id:
            return self._by_id[str(rid)]
        return self._by_text.get((request.prompt.strip(), request.target_new.strip()))

    def info(self) -> dict[str, Any]:
        op = self.op
        return {
            "kind": "aloe",
            "n_slots": op.n,
            "layer": self.layer,
            "module_path": op.module_path,
            "base_model": op.base_model,
            "operator_hash": op.fingerprint(),
            "weight_fingerprint": op.weight_fingerprint,
        }


# =============================================================================
# Tokenization
# =============================================================================


def _ids(tokenizer, text: str, special: bool = True) -> list[int]:
    ids = list(tokenizer(text, add_special_tokens=special)["input_ids"])
    eos = tokenizer.eos_token_id
    # a tokenizer that appends EOS would put it between the prompt and its continuation
    if special and ids and eos is not None and ids[-1] == eos and eos != tokenizer.bos_token_id:
        ids = ids[:-1]
    return ids


def encode_continuation(tokenizer, prompt: str, text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(prompt_ids, continuation_ids)`` for ``prompt + " " + text``.

    The prompt is tokenized as the model sees it (special tokens included,
    as EasyEdit does). The continuation is what follows the prompt's tokens
    in the tokenization of ``prompt + " " + text``; if that tokenization does
    not start with the prompt's tokens (a merge across the boundary), it is
    ``" " + text`` tokenized on its own.
    """
    p = _ids(tokenizer, prompt)
    f = _ids(tokenizer, prompt + " " + text.strip())
    if len(f) > len(p) and f[: len(p)] == p:
        cont = f[len(p):]
    else:
        cont = _ids(tokenizer, " " + text.strip(), special=False)
    if not cont:
        raise ValueError(f"{text!r} tokenizes to no tokens after {prompt!r}")
    return tuple(p), tuple(cont)


# =============================================================================
# Metric primitives
# =============================================================================


def exact_match(generated: str, answer: str) -> bool:
    """Exact match of a decoded generation to an answer: equal after ``strip()``."""
    return generated.strip() == answer.strip()


def token_accuracy(predicted: Sequence[int], labels: Sequence[int]) -> float:
    """Share of positions where ``predicted`` equals ``labels`` (EasyEdit's ``np.mean(np.equal(...))``)."""
    if len(predicted) != len(labels):
        raise ValueError(f"length mismatch: {len(predicted)} predictions, {len(labels)} labels")
    if not labels:
        return float("nan")
    return sum(int(a == b) for a, b in zip(predicted, labels)) / len(labels)


def relative_drift(edited: torch.Tensor, reference: torch.Tensor) -> float:
    """``|edited - reference| / |reference|`` (L2)."""
    ref = reference.double()
    return float((edited.double() - ref).norm() / ref.norm().clamp_min(1e-12))


# =============================================================================
# Forward passes
# =============================================================================


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


def _batches(order: list[int], size: int) -> Iterable[list[int]]:
    for i in range(0, len(order), size):
        yield order[i: i + size]


def _left_pad(seqs: list[Sequence[int]], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            ids[i, T - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, T - len(s):] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), pos.to(device)


def _pad_id(tokenizer) -> int:
    pid = tokenizer.pad_token_id
    if pid is None:
        pid = tokenizer.eos_token_id
    if pid is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token")
    return int(pid)


def _model_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:  # pragma: no cover
        return torch.device("cpu")


def _bar(total: int, desc: str, progress: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not progress, leave=False, file=sys.stderr, dynamic_ncols=True)


def teacher_forced(
    model: nn.Module,
    seqs: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    pad_id: int,
    batch_size: int = 32,
    editor: Editor | None = None,
    hidden: Sequence[bool] | bool = False,
    progress: bool = False,
    desc: str = "teacher-forced",
) -> list[TFResult]:
    """One teacher-forced forward over each ``(prompt_ids, continuation_ids)``.

    Returns, per sequence, the argmax prediction and NLL for every
    continuation token; the final hidden state at the last prompt token when
    ``hidden`` asks for it; and, when ``editor`` has slots, the nonzero slot
    activations at the last prompt token and the maximum over all prompt
    tokens. Sequences are sorted by length and left-padded; only the logits
    of the last ``max(k) + 1`` positions are computed.
    """
    n = len(seqs)
    out: list[TFResult | None] = [None] * n
    if n == 0:
        return []
    want_hidden = [bool(hidden)] * n if isinstance(hidden, bool) else [bool(x) for x in hidden]
    device = _model_device(model)
    order = sorted(range(n), key=lambda i: (len(seqs[i][0]) + len(seqs[i][1]), i))
    slot_site = None
    if editor is not None and editor.has_slots:
        from aloe_kernels.hf import locate_down_proj

        slot_site = locate_down_proj(model, editor.layer).module
    head = model.get_output_embeddings()
    state: dict[str, Any] = {}

    def on_down(_m, args, _o):
        state["h"] = args[0].detach()

    def on_head(_m, args, _o):
        state["final"] = args[0].detach()

    handles = [head.register_forward_hook(on_head)]
    if slot_site is not None:
        handles.append(slot_site.register_forward_hook(on_down))
    bar = _bar(n, desc, progress)
    try:
        with torch.inference_mode():
            for batch in _batches(order, batch_size):
                full = [list(seqs[i][0]) + list(seqs[i][1]) for i in batch]
                ks = [len(seqs[i][1]) for i in batch]
                kmax = max(ks)
                ids, mask, pos = _left_pad(full, pad_id, device)
                T = ids.shape[1]
                state.clear()
                res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False,
                            logits_to_keep=kmax + 1)
                logp = torch.log_softmax(res.logits[:, -(kmax + 1):].float(), dim=-1)  # (B, kmax+1, V)
                final = state.get("final")
                if final is not None:
                    final = final[:, -(kmax + 1):]
                acts = editor.slot_activations(state["h"]) if slot_site is not None else None  # (B, T, n)
                for b, i in enumerate(batch):
                    k = ks[b]
                    lo = kmax - k
                    lp = logp[b, lo: lo + k]
                    cont = torch.tensor(seqs[i][1], device=lp.device)
                    r = TFResult(
                        preds=tuple(int(x) for x in lp.argmax(-1).tolist()),
                        nll=float(-lp.gather(1, cont[:, None]).mean()),
                    )
                    if want_hidden[i] and final is not None:
                        r.hidden = final[b, lo].float().cpu().clone()
                    if acts is not None:
                        last = T - 1 - k
                        first = T - len(full[b])
                        a_last = acts[b, last]
                        nz = a_last.nonzero().flatten()
                        r.gate_idx = nz.cpu()
                        r.gate_val = a_last[nz].cpu()
                        span = acts[b, first: last + 1]
                        if span.numel():
                            flat = span.max(0).values
                            j = int(flat.argmax())
                            r.prompt_max_gate = float(flat[j])
                            r.prompt_max_slot = j if r.prompt_max_gate > 0 else None
                        else:
                            r.prompt_max_gate, r.prompt_max_slot = 0.0, None
                    out[i] = r
                bar.update(len(batch))
    finally:
        bar.close()
        for h in handles:
            h.remove()
    return out  # type: ignore[return-value]


def greedy_generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    lengths: Sequence[int] | int,
    *,
    pad_id: int,
    batch_size: int = 32,
    progress: bool = False,
    desc: str = "generate",
) -> list[list[int]]:
    """Greedy generation of exactly ``lengths[i]`` tokens after each prompt (token ids).

    Batched with left padding and a KV cache; position ids follow the
    attention mask as in ``model.generate``. Generation does not stop at EOS
    (the caller decides what a generated EOS means); each batch stops after
    its longest requested length.
    """
    n = len(prompts)
    ks = [int(lengths)] * n if isinstance(lengths, int) else [int(x) for x in lengths]
    out: list[list[int]] = [[] for _ in range(n)]
    if n == 0:
        return out
    device = _model_device(model)
    order = sorted(range(n), key=lambda i: (ks[i], len(prompts[i]), i))
    bar = _bar(n, desc, progress)
    try:
        with torch.inference_mode():
            for batch in _batches(order, batch_size):
                kmax = max(ks[i] for i in batch)
                if kmax <= 0:
                    bar.update(len(batch))
                    continue
                ids, mask, pos = _left_pad([prompts[i] for i in batch], pad_id, device)
                res = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
                nxt = res.logits[:, -1].argmax(-1)
                steps = [nxt]
                past = res.past_key_values
                pos = pos[:, -1:]
                for _ in range(1, kmax):
                    mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
                    pos = pos + 1
                    res = model(input_ids=nxt[:, None], attention_mask=mask, position_ids=pos, past_key_values=past,
                                use_cache=True, logits_to_keep=1)
                    past = res.past_key_values
                    nxt = res.logits[:, -1].argmax(-1)
                    steps.append(nxt)
                gen = torch.stack(steps, dim=1).cpu()
                for b, i in enumerate(batch):
                    out[i] = [int(x) for x in gen[b, : ks[i]].tolist()]
                bar.update(len(batch))
    finally:
        bar.close()
    return out


# =============================================================================
# Queries
# =============================================================================


@dataclasses.dataclass
class _Rephrase:
    prompt: str
    seq: int


@dataclasses.dataclass
class _Locality:
    prompt: str
    kind: str
    ground_truth: str | None
    prompt_ids: tuple[int, ...]
    k: int
    tf_seq: int | None  # EasyEdit: prompt + " " + ground_truth[0]
    gen_seq: int | None = None  # prompt + unedited greedy continuation (set after the reference pass)


@dataclasses.dataclass
class _Portability:
    prompt: str
    kind: str
    answers: tuple[str, ...]
    seq: int  # prompt + " " + answers[0]
    answer_ids: tuple[tuple[int, ...], ...]  # continuation ids of each answer


@dataclasses.dataclass
class _EditPlan:
    index: int
    request: Any
    seq: int
    rephrases: list[_Rephrase]
    locality: list[_Locality]
    portability: list[_Portability]


class _Registry:
    """Unique (prompt_ids, continuation_ids) sequences: each is scored once per editor."""

    def __init__(self) -> None:
        self.seqs: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
        self.want_hidden: list[bool] = []
        self._index: dict[tuple, int] = {}

    def add(self, prompt_ids: tuple[int, ...], cont: tuple[int, ...], hidden: bool = False) -> int:
        key = (prompt_ids, cont)
        j = self._index.get(key)
        if j is None:
            j = self._index[key] = len(self.seqs)
            self.seqs.append(key)
            self.want_hidden.append(hidden)
        elif hidden:
            self.want_hidden[j] = True
        return j


def _plan(tokenizer, requests: Sequence[Any]) -> tuple[_Registry, list[_EditPlan]]:
    reg = _Registry()
    plans = []
    for i, r in enumerate(requests):
        p, c = encode_continuation(tokenizer, r.prompt, r.target_new)
        seq = reg.add(p, c)
        reph = []
        for text in r.rephrases:
            rp, rc = encode_continuation(tokenizer, text, r.target_new)
            reph.append(_Rephrase(text, reg.add(rp, rc)))
        loc = []
        for lp in r.locality:
            gt = lp.ground_truth[0] if lp.ground_truth else None
            pids = tuple(_ids(tokenizer, lp.prompt))
            if gt is not None:
                gp, gc = encode_continuation(tokenizer, lp.prompt, gt)
                k = max(1, min(len(gc), LOCALITY_MAX_TOKENS))
                tf_seq = reg.add(gp, gc)
            else:
                k, tf_seq = LOCALITY_DEFAULT_TOKENS, None
            loc.append(_Locality(lp.prompt, lp.kind, gt, pids, k, tf_seq))
        port = []
        for pp in r.portability:
            if not pp.ground_truth:
                continue
            enc = [encode_continuation(tokenizer, pp.prompt, a) for a in pp.ground_truth]
            seq_p = reg.add(*enc[0])
            port.append(_Portability(pp.prompt, pp.kind, tuple(pp.ground_truth), seq_p, tuple(e[1] for e in enc)))
        plans.append(_EditPlan(i, r, seq, reph, loc, port))
    return reg, plans


# =============================================================================
# Results
# =============================================================================


@dataclasses.dataclass
class EditorResult:
    """One editor's per-edit rows and summary (JSON-ready) plus plot data."""

    name: str
    summary: dict[str, Any]
    rows: list[dict[str, Any]]
    info: dict[str, Any]
    plots: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "info": self.info, "summary": self.summary, "plots": self.plots, "rows": self.rows}


@dataclasses.dataclass
class EvalReport:
    """The report of :func:`evaluate`.

    ``editors`` maps each editor's name to its :class:`EditorResult`;
    ``primary`` names the editor passed as ``op`` (``.summary`` and ``.rows``
    are its). Everything is JSON-serialisable through :meth:`to_dict`.
    """

    meta: dict[str, Any]
    editors: dict[str, EditorResult]
    primary: str

    @property
    def summary(self) -> dict[str, Any]:
        return self.editors[self.primary].summary

    @property
    def rows(self) -> list[dict[str, Any]]:
        return self.editors[self.primary].rows

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "meta": self.meta,
            "primary": self.primary,
            "definitions": METRIC_DEFINITIONS,
            "editors": {k: v.to_dict() for k, v in self.editors.items()},
        }

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(_jsonable(self.to_dict()), indent=indent, ensure_ascii=False, allow_nan=False)

    def to_markdown(self) -> str:
        return render_markdown(self.to_dict())

    def save(self, out_dir: str | os.PathLike, plots: bool = True) -> dict[str, Path]:
        """Write ``eval_report.json``, ``eval_report.md`` and (if ``plots``) PNG figures; returns the paths."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"json": out / "eval_report.json", "markdown": out / "eval_report.md"}
        paths["json"].write_text(self.to_json() + "\n")
        paths["markdown"].write_text(self.to_markdown())
        if plots:
            from .eval_plots import plot_report

            for key, p in plot_report(self.to_dict(), out).items():
                paths[f"plot:{key}"] = p
        return paths

    @classmethod
    def load(cls, path: str | os.PathLike) -> "EvalReport":
        d = json.loads(Path(path).read_text())
        eds = {k: EditorResult(v["name"], v["summary"], v["rows"], v["info"], v.get("plots", {}))
               for k, v in d["editors"].items()}
        return cls(d["meta"], eds, d["primary"])


def _jsonable(x: Any) -> Any:
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor):
        return _jsonable(x.tolist())
    return x


def _mean(xs: Iterable[float | None]) -> float | None:
    v = [float(x) for x in xs if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(v) / len(v) if v else None


def _dist(xs: Sequence[float]) -> dict[str, Any] | None:
    v = sorted(float(x) for x in xs)
    if not v:
        return None

    def q(p: float) -> float:
        return v[min(len(v) - 1, max(0, int(round(p * (len(v) - 1)))))]

    return {"n": len(v), "mean": sum(v) / len(v), "median": q(0.5), "p10": q(0.1), "p90": q(0.9),
            "min": v[0], "max": v[-1]}


def _share(xs: Sequence[bool]) -> float | None:
    return sum(1 for x in xs if x) / len(xs) if xs else None


# =============================================================================
# Evaluation
# =============================================================================


class _Reference:
    """The unedited model's locality generations and teacher-forced results, computed once."""

    def __init__(self) -> None:
        self.cache: dict[int, TFResult] = {}  # registry index -> unedited TFResult


def _decode(tokenizer, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True)


def _build_reference(model, tokenizer, reg: _Registry, plans: list[_EditPlan], *, pad_id: int, batch_size: int,
                     progress: bool, timings: dict[str, float]) -> _Reference:
    ref = _Reference()
    t0 = time.perf_counter()
    # 1. the unedited model's greedy continuations of every unique locality prompt
    uniq: dict[tuple[tuple[int, ...], int], int] = {}
    items = [lp for p in plans for lp in p.locality]
    for lp in items:
        uniq.setdefault((lp.prompt_ids, lp.k), len(uniq))
    keys = list(uniq)
    gens = greedy_generate(model, [k[0] for k in keys], [k[1] for k in keys], pad_id=pad_id, batch_size=batch_size,
                           progress=progress, desc="unedited: locality generations")
    for lp in items:
        g = gens[uniq[(lp.prompt_ids, lp.k)]]
        lp.gen_seq = reg.add(lp.prompt_ids, tuple(g), hidden=True)
    # 2. the unedited teacher-forced pass over everything locality needs
    need = sorted({lp.gen_seq for lp in items} | {lp.tf_seq for lp in items if lp.tf_seq is not None})
    res = teacher_forced(model, [reg.seqs[j] for j in need], pad_id=pad_id, batch_size=batch_size,
                         hidden=[reg.want_hidden[j] for j in need], progress=progress,
                         desc="unedited: locality reference")
    ref.cache.update(zip(need, res))
    timings["reference_s"] = time.perf_counter() - t0
    return ref


def _score_editor(model, tokenizer, editor: Editor, reg: _Registry, plans: list[_EditPlan], ref: _Reference, *,
                  pad_id: int, batch_size: int, progress: bool, open_threshold: float,
                  heatmap_size: int = 32, pca_points: int = 1024) -> EditorResult:
    t0 = time.perf_counter()
    unedited = isinstance(editor, UneditedEditor)
    timings: dict[str, float] = {}
    editor.attach(model)
    try:
        todo = list(range(len(reg.seqs)))
        if unedited:
            todo = [j for j in todo if j not in ref.cache]
        t = time.perf_counter()
        res = teacher_forced(model, [reg.seqs[j] for j in todo], pad_id=pad_id, batch_size=batch_size,
                             editor=editor, hidden=[reg.want_hidden[j] for j in todo], progress=progress,
                             desc=f"{editor.name}: teacher-forced")
        tf: dict[int, TFResult] = dict(zip(todo, res))
        if unedited:
            tf.update(ref.cache)
        timings["teacher_forced_s"] = time.perf_counter() - t

        # greedy generation where the teacher-forced pass says "not the target"
        def all_right(j: int) -> bool:
            return tf[j].preds == reg.seqs[j][1]

        gen_jobs: dict[tuple[tuple[int, ...], int], None] = {}
        for p in plans:
            for j in [p.seq] + [r.seq for r in p.rephrases]:
                if not all_right(j):
                    gen_jobs[(reg.seqs[j][0], len(reg.seqs[j][1]))] = None
            for pp in p.portability:
                if not all_right(pp.seq):
                    k = min(PORTABILITY_MAX_TOKENS, max(len(a) for a in pp.answer_ids))
                    gen_jobs[(reg.seqs[pp.seq][0], k)] = None
        jobs = list(gen_jobs)
        t = time.perf_counter()
        gens = greedy_generate(model, [j[0] for j in jobs], [j[1] for j in jobs], pad_id=pad_id,
                               batch_size=batch_size, progress=progress, desc=f"{editor.name}: generate misses")
        generated = dict(zip(jobs, gens))
        timings["generate_s"] = time.perf_counter() - t
        timings["n_generated"] = len(jobs)
    finally:
        editor.detach(model)

    slots = editor.has_slots

    def gen_text(j: int) -> tuple[bool, str]:
        """Paper exact match of sequence j (request or rephrase) and the text the model generates."""
        p, c = reg.seqs[j]
        if all_right(j):
            return True, _decode(tokenizer, c)
        g = generated[(p, len(c))]
        return False, _decode(tokenizer, g)

    rows = []
    req_gates, reph_gates, loc_max = [], [], []
    dominates, reph_dominates = [], []
    fail = {"efficacy": defaultdict(int), "generalization": defaultdict(int)}
    drifts, agree = [], []
    pca_pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    seen_loc: set[int] = set()

    def slot_diag(j: int, slot: int | None, hit: bool, bucket: str) -> dict[str, Any]:
        if not slots:
            return {}
        r = tf[j]
        g = r.gate(slot)
        top_slot, top_gate = r.top()
        dom = slot is not None and g > 0 and top_gate <= g
        failure = None
        if not hit:
            failure = "unmapped" if slot is None else ("write" if g >= open_threshold else "address")
            fail[bucket][failure] += 1
        return {"gate": g, "top_slot": top_slot, "top_gate": top_gate, "dominates": dom, "failure": failure,
                "open_slots": int(r.gate_idx.numel()) if r.gate_idx is not None else 0}

    for p in plans:
        r = p.request
        slot = editor.slot_of(r, p.index) if slots else None
        seq_r = reg.seqs[p.seq]
        hit_tf, text = gen_text(p.seq)
        eff = hit_tf or exact_match(text, r.target_new)
        row: dict[str, Any] = {
            "id": r.id if r.id is not None else f"edit-{p.index}",
            "prompt": r.prompt,
            "target": r.target_new,
            "slot": slot,
            "efficacy": float(eff),
            "generation": text,
            "rewrite_acc": token_accuracy(tf[p.seq].preds, seq_r[1]),
            "target_nll": tf[p.seq].nll,
        }
        if slots:
            d = slot_diag(p.seq, slot, eff, "efficacy")
            row.update({f"request_{k}": v for k, v in d.items()})
            req_gates.append(d["gate"])
            dominates.append(d["dominates"])
        reph_rows = []
        for rp in p.rephrases:
            hit_tf, text = gen_text(rp.seq)
            em = hit_tf or exact_match(text, r.target_new)
            rr = {"prompt": rp.prompt, "em": float(em), "generation": text,
                  "tf_acc": token_accuracy(tf[rp.seq].preds, reg.seqs[rp.seq][1])}
            if slots:
                d = slot_diag(rp.seq, slot, em, "generalization")
                rr.update(d)
                reph_gates.append(d["gate"])
                reph_dominates.append(d["dominates"])
            reph_rows.append(rr)
        row["generalization"] = _mean(x["em"] for x in reph_rows)
        row["rephrase_acc"] = _mean(x["tf_acc"] for x in reph_rows)
        row["rephrases"] = reph_rows

        loc_rows = []
        for lp in p.locality:
            j = lp.gen_seq
            ref_r, ed_r = ref.cache[j], tf[j]
            stable = ed_r.preds == ref_r.preds
            lr: dict[str, Any] = {
                "prompt": lp.prompt, "kind": lp.kind, "ground_truth": lp.ground_truth, "k": len(reg.seqs[j][1]),
                "stable": float(stable),
                "reference": _decode(tokenizer, ref_r.preds),
                "generation": _decode(tokenizer, ed_r.preds),
                "next_token_agree": float(ed_r.preds[0] == ref_r.preds[0]),
            }
            if ref_r.hidden is not None and ed_r.hidden is not None:
                lr["drift"] = relative_drift(ed_r.hidden, ref_r.hidden)
            if lp.tf_seq is not None:
                lr["tf_stability"] = token_accuracy(tf[lp.tf_seq].preds, ref.cache[lp.tf_seq].preds)
            if slots:
                lr["max_gate"] = ed_r.prompt_max_gate
                lr["max_slot"] = ed_r.prompt_max_slot
            if j not in seen_loc:  # distribution statistics over unique locality prompts
                seen_loc.add(j)
                agree.append(bool(lr["next_token_agree"]))
                if "drift" in lr:
                    drifts.append(lr["drift"])
                    if len(pca_pairs) < pca_points:
                        pca_pairs.append((ref_r.hidden, ed_r.hidden))
                if slots:
                    loc_max.append(ed_r.prompt_max_gate or 0.0)
            loc_rows.append(lr)
        row["locality"] = _mean(x["stable"] for x in loc_rows)
        row["locality_tf"] = _mean(x.get("tf_stability") for x in loc_rows)
        row["locality_prompts"] = loc_rows

        port_rows = []
        for pp in p.portability:
            seq = reg.seqs[pp.seq]
            if all_right(pp.seq):
                em, text = True, _decode(tokenizer, seq[1])
            else:
                k = min(PORTABILITY_MAX_TOKENS, max(len(a) for a in pp.answer_ids))
                g = generated[(seq[0], k)]
                text = _decode(tokenizer, g)
                em = any(exact_match(_decode(tokenizer, g[: len(a_ids)]), a)
                         for a, a_ids in zip(pp.answers, pp.answer_ids))
            pr = {"prompt": pp.prompt, "kind": pp.kind, "answers": list(pp.answers), "em": float(em),
                  "generation": text, "tf_acc": token_accuracy(tf[pp.seq].preds, seq[1])}
            if slots:
                pr["max_gate"] = tf[pp.seq].prompt_max_gate
            port_rows.append(pr)
        row["portability"] = _mean(x["em"] for x in port_rows)
        row["portability_tf"] = _mean(x["tf_acc"] for x in port_rows)
        row["portability_prompts"] = port_rows
        rows.append(row)

    summary = _summarize(rows, slots=slots, open_threshold=open_threshold, req_gates=req_gates,
                         reph_gates=reph_gates, loc_max=loc_max, dominates=dominates, reph_dominates=reph_dominates,
                         fail=fail, drifts=drifts, agree=agree)
    plots: dict[str, Any] = {}
    if slots:
        plots["heatmap"] = _heatmap(editor, plans, tf, heatmap_size)
        plots["gates"] = {"request": req_gates, "rephrase": reph_gates, "locality_max": loc_max}
    if pca_pairs and not unedited:
        plots["pca"] = _pca(pca_pairs)
    timings["total_s"] = time.perf_counter() - t0
    info = {**editor.info(), "timings": timings}
    return EditorResult(editor.name, summary, rows, info, plots)


def _macro_by_kind(rows: list[dict], list_key: str, value_key: str) -> dict[str, float]:
    per_kind: dict[str, list[float]] = defaultdict(list)
    for row in rows:
        groups: dict[str, list[float]] = defaultdict(list)
        for x in row[list_key]:
            if x.get(value_key) is not None:
                groups[x["kind"]].append(x[value_key])
        for kind, vals in groups.items():
            per_kind[kind].append(sum(vals) / len(vals))
    return {k: sum(v) / len(v) for k, v in sorted(per_kind.items())}


def _summarize(rows, *, slots, open_threshold, req_gates, reph_gates, loc_max, dominates, reph_dominates, fail,
               drifts, agree) -> dict[str, Any]:
    n_reph = sum(len(r["rephrases"]) for r in rows)
    n_loc = sum(len(r["locality_prompts"]) for r in rows)
    n_port = sum(len(r["portability_prompts"]) for r in rows)
    s: dict[str, Any] = {
        "counts": {
            "edits": len(rows),
            "rephrases": n_reph,
            "locality_prompts": n_loc,
            "portability_prompts": n_port,
            "edits_with_rephrases": sum(1 for r in rows if r["rephrases"]),
            "edits_with_locality": sum(1 for r in rows if r["locality_prompts"]),
            "edits_with_portability": sum(1 for r in rows if r["portability_prompts"]),
        },
        "paper": {
            "efficacy": _mean(r["efficacy"] for r in rows),
            "generalization": _mean(r["generalization"] for r in rows),
            "locality": _mean(r["locality"] for r in rows),
            "portability": _mean(r["portability"] for r in rows),
            "locality_by_kind": _macro_by_kind(rows, "locality_prompts", "stable"),
            "portability_by_kind": _macro_by_kind(rows, "portability_prompts", "em"),
        },
        "easyedit": {
            "rewrite_acc": _mean(r["rewrite_acc"] for r in rows),
            "rephrase_acc": _mean(r["rephrase_acc"] for r in rows),
            "locality": _mean(r["locality_tf"] for r in rows),
            "portability": _mean(r["portability_tf"] for r in rows),
            "locality_by_kind": _macro_by_kind(rows, "locality_prompts", "tf_stability"),
            "portability_by_kind": _macro_by_kind(rows, "portability_prompts", "tf_acc"),
        },
        "locality_states": {
            "drift": _dist(drifts),
            "next_token_agreement": _share(agree),
            "n_unique_prompts": len(agree),
        },
    }
    if slots:

        def fails(bucket: str, misses: int) -> dict[str, Any]:
            f = dict(fail[bucket])
            out = {k: int(f.get(k, 0)) for k in ("address", "write", "unmapped")}
            out["misses"] = misses
            return out

        eff_miss = sum(1 for r in rows if r["efficacy"] < 1)
        gen_miss = sum(1 for r in rows for x in r["rephrases"] if x["em"] < 1)
        s["diagnostics"] = {
            "open_threshold": open_threshold,
            "request_matched_gate": _dist(req_gates),
            "request_gate_open": _share([g >= open_threshold for g in req_gates]),
            "rephrase_matched_gate": _dist(reph_gates),
            "rephrase_gate_open": _share([g >= open_threshold for g in reph_gates]),
            "matched_slot_dominates": _share(dominates),
            "rephrase_matched_slot_dominates": _share(reph_dominates),
            "locality_max_gate": _dist(loc_max),
            "locality_gate_open": _share([g >= open_threshold for g in loc_max]),
            "locality_gate_nonzero": _share([g > 0 for g in loc_max]),
            "failures": {"efficacy": fails("efficacy", eff_miss), "generalization": fails("generalization", gen_miss)},
            "unmapped_edits": sum(1 for r in rows if r["slot"] is None),
        }
    return s


def _heatmap(editor: Editor, plans: list[_EditPlan], tf: dict[int, TFResult], size: int) -> dict[str, Any]:
    """Gates of the first ``size`` requests (rows) at the slots of the first ``size`` edits (columns)."""
    sel = plans[:size]
    cols = [editor.slot_of(p.request, p.index) for p in sel]
    matrix = [[tf[p.seq].gate(c) if c is not None else 0.0 for c in cols] for p in sel]
    return {"row_ids": [str(p.request.id) for p in sel], "col_slots": cols, "matrix": matrix}


def _pca(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    ref = torch.stack([a for a, _ in pairs]).double()
    ed = torch.stack([b for _, b in pairs]).double()
    both = torch.cat([ref, ed])
    mu = both.mean(0, keepdim=True)
    x = both - mu
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    comps = vh[:2]
    var = s**2
    explained = (var[:2] / var.sum().clamp_min(1e-30)).tolist()
    pr = ((ref - mu) @ comps.T).tolist()
    pe = ((ed - mu) @ comps.T).tolist()
    return {"reference": pr, "edited": pe, "explained": explained}


# =============================================================================
# The public entry point
# =============================================================================


def _as_editor(x: Any, name_hint: str | None, layer: int | None) -> Editor:
    from aloe_kernels import AloeOperator

    if isinstance(x, Editor):
        return x
    if isinstance(x, AloeOperator):
        return AloeEditor(x, layer=layer if x.layer is None else None)
    if isinstance(x, (str, os.PathLike)):
        return AloeEditor(AloeOperator.load(x), layer=layer)
    raise TypeError(f"cannot evaluate {type(x).__name__}: pass an AloeOperator, an Editor, or an artifact path")


def evaluate(
    model: nn.Module,
    tokenizer,
    requests: Sequence[Any],
    op: Any = None,
    *,
    batch_size: int = 32,
    progress: bool = True,
    baseline: str | Editor | Sequence[str | Editor] | None = None,
    layer: int | None = None,
    open_threshold: float = 0.5,
    grace_config: Any = None,
    meta: Mapping[str, Any] | None = None,
) -> EvalReport:
    """Score editors on one model and one edit stream; returns an :class:`EvalReport`.

    Args:
        model, tokenizer: an unpatched causal LM and its tokenizer (any padding
            side; sequences are left-padded here).
        requests: the edit stream (``aloe_build.data.EditRequest``).
        op: the editor under test: an ``AloeOperator`` (or an artifact
            directory), any :class:`Editor`, or ``None`` when only baselines
            are wanted.
        batch_size: sequences per forward pass.
        progress: show tqdm bars on stderr.
        baseline: further editors on the same model, layer and stream:
            ``"unedited"``, ``"grace"`` (the GRACE reimplementation of
            :mod:`aloe_build.grace`, fitted here on ``requests``), an
            :class:`Editor`, or a list of these.
        layer: the edited layer for baselines (default: the operator's layer,
            else ``aloe_build.models.default_layer(model)``).
        open_threshold: a gate counts as open at or above this value.
        grace_config: an ``aloe_build.grace.GraceConfig`` for ``"grace"``.
        meta: extra metadata for the report (data file, its hash, command).

    Each editor is patched in, scored, and removed again; the model is left
    as it came. The unedited model's locality generations are computed once
    and shared by all editors.
    """
    from aloe_kernels.hf import find_aloe_modules

    if find_aloe_modules(model):
        raise ValueError("the model already carries an ALOE patch; pass the unpatched model and the operator")
    requests = list(requests)
    if not requests:
        raise ValueError("no edit requests to evaluate")
    t_start = time.perf_counter()
    primary = _as_editor(op, None, layer) if op is not None else None
    if layer is None:
        layer = primary.layer if primary is not None and primary.layer is not None else None
    if layer is None:
        from .models import default_layer

        layer = default_layer(model)
    if baseline is None:
        bl: list = []
    elif isinstance(baseline, (str, Editor)):
        bl = [baseline]
    else:
        bl = list(baseline)
    editors: list[Editor] = [primary] if primary is not None else []
    timings: dict[str, float] = {}
    for b in bl:
        if isinstance(b, Editor):
            editors.append(b)
        elif str(b).lower() in ("unedited", "none", "base"):
            editors.append(UneditedEditor(layer))
        elif str(b).lower() == "grace":
            from .grace import GraceConfig, fit_grace

            t = time.perf_counter()
            editors.append(fit_grace(model, tokenizer, requests, layer, grace_config or GraceConfig(),
                                     batch_size=min(batch_size, 16), progress=progress))
            timings["grace_fit_s"] = time.perf_counter() - t
        else:
            raise ValueError(f"unknown baseline {b!r}: expected 'unedited', 'grace' or an Editor")
    if not editors:
        editors = [UneditedEditor(layer)]
    names = [e.name for e in editors]
    if len(set(names)) != len(names):
        raise ValueError(f"editor names must be distinct, got {names}")

    pad_id = _pad_id(tokenizer)
    reg, plans = _plan(tokenizer, requests)
    ref = _build_reference(model, tokenizer, reg, plans, pad_id=pad_id, batch_size=batch_size, progress=progress,
                           timings=timings)
    results: dict[str, EditorResult] = {}
    for ed in editors:
        results[ed.name] = _score_editor(model, tokenizer, ed, reg, plans, ref, pad_id=pad_id, batch_size=batch_size,
                                         progress=progress, open_threshold=open_threshold)
    timings["total_s"] = time.perf_counter() - t_start

    from .models import model_name

    import transformers

    m: dict[str, Any] = {
        "model": model_name(model),
        "model_class": type(model).__name__,
        "layer": layer,
        "n_edits": len(requests),
        "editors": names,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "batch_size": batch_size,
            "open_threshold": open_threshold,
            "locality_max_tokens": LOCALITY_MAX_TOKENS,
            "locality_default_tokens": LOCALITY_DEFAULT_TOKENS,
            "portability_max_tokens": PORTABILITY_MAX_TOKENS,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "device": str(_model_device(model)),
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__},
        "host": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform()},
        "timings": timings,
        "unique_sequences": len(reg.seqs),
    }
    if isinstance(primary, AloeEditor):
        m["operator_hash"] = primary.op.fingerprint()
        m["operator_n"] = primary.op.n
    if meta:
        m.update(dict(meta))
    return EvalReport(_jsonable(m), results, names[0])


# =============================================================================
# Markdown
# =============================================================================


def _f(x: Any, digits: int = 3) -> str:
    if x is None:
        return "–"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def render_markdown(report: Mapping[str, Any]) -> str:
    """The report as Markdown tables (paper protocol, EasyEdit numbers, diagnostics)."""
    meta = report["meta"]
    eds = report["editors"]
    lines = [f"# Editing evaluation: {meta.get('model')} layer {meta.get('layer')}", ""]
    facts = [
        ("model", meta.get("model")),
        ("edits", meta.get("n_edits")),
        ("data", meta.get("data_file")),
        ("data sha256", meta.get("data_sha256")),
        ("operator", meta.get("operator_dir")),
        ("operator hash", meta.get("operator_hash")),
        ("command", f"`{meta['command']}`" if meta.get("command") else None),
        ("created", meta.get("created")),
        ("total time", f"{meta['timings']['total_s']:.1f} s" if meta.get("timings", {}).get("total_s") else None),
    ]
    lines += [f"- **{k}**: {v}" for k, v in facts if v is not None]
    lines += ["", "## Paper protocol (greedy-generation exact match)", "",
              "| Editor | Eff. | Gen. | Loc. | Port. |", "|---|---|---|---|---|"]
    for name, e in eds.items():
        p = e["summary"]["paper"]
        lines.append(f"| {name} | {_f(p['efficacy'])} | {_f(p['generalization'])} | {_f(p['locality'])} | "
                     f"{_f(p['portability'])} |")
    kinds = sorted({k for e in eds.values() for k in e["summary"]["paper"]["portability_by_kind"]})
    lkinds = sorted({k for e in eds.values() for k in e["summary"]["paper"]["locality_by_kind"]})
    if len(lkinds) > 1 or kinds:
        cols = [f"Loc. {k}" for k in lkinds] + [f"Port. {k}" for k in kinds]
        lines += ["", "| Editor | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
        for name, e in eds.items():
            p = e["summary"]["paper"]
            vals = [p["locality_by_kind"].get(k) for k in lkinds] + [p["portability_by_kind"].get(k) for k in kinds]
            lines.append(f"| {name} | " + " | ".join(_f(v) for v in vals) + " |")
    lines += ["", "## EasyEdit teacher-forced token accuracy (not comparable with the table above)", "",
              "| Editor | rewrite_acc | rephrase_acc | locality | portability |", "|---|---|---|---|---|"]
    for name, e in eds.items():
        q = e["summary"]["easyedit"]
        lines.append(f"| {name} | {_f(q['rewrite_acc'])} | {_f(q['rephrase_acc'])} | {_f(q['locality'])} | "
                     f"{_f(q['portability'])} |")
    lines += ["", "## Locality states", "", "| Editor | mean drift | median drift | next-token agreement |",
              "|---|---|---|---|"]
    for name, e in eds.items():
        ls = e["summary"]["locality_states"]
        d = ls.get("drift") or {}
        lines.append(f"| {name} | {_f(d.get('mean'), 4)} | {_f(d.get('median'), 4)} | "
                     f"{_f(ls.get('next_token_agreement'))} |")
    diag = [(n, e["summary"]["diagnostics"]) for n, e in eds.items() if "diagnostics" in e["summary"]]
    if diag:
        lines += ["", f"## Mechanism diagnostics (open = gate >= {diag[0][1]['open_threshold']})", "",
                  "| Editor | request gate (mean / median) | request open | dominates | rephrase gate (mean) | "
                  "rephrase open | locality max gate (mean) | locality open | efficacy misses: address / write | "
                  "generalization misses: address / write |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for name, d in diag:
            rg, pg, lg = d["request_matched_gate"] or {}, d["rephrase_matched_gate"] or {}, d["locality_max_gate"] or {}
            fe, fg = d["failures"]["efficacy"], d["failures"]["generalization"]
            lines.append(
                f"| {name} | {_f(rg.get('mean'))} / {_f(rg.get('median'))} | {_f(d['request_gate_open'])} | "
                f"{_f(d['matched_slot_dominates'])} | {_f(pg.get('mean'))} | {_f(d['rephrase_gate_open'])} | "
                f"{_f(lg.get('mean'))} | {_f(d['locality_gate_open'])} | {fe['address']} / {fe['write']} of "
                f"{fe['misses']} | {fg['address']} / {fg['write']} of {fg['misses']} |")
    lines += ["", "## Definitions", ""]
    lines += [f"- `{k}`: {v}" for k, v in report.get("definitions", METRIC_DEFINITIONS).items()]
    info_lines = []
    for name, e in eds.items():
        inf = {k: v for k, v in e["info"].items() if k != "timings"}
        t = e["info"].get("timings", {})
        info_lines.append(f"- **{name}**: {json.dumps(inf, ensure_ascii=False)}; time {t.get('total_s', 0):.1f} s")
    lines += ["", "## Editors", ""] + info_lines + [""]
    return "\n".join(lines)


# =============================================================================
# Command line
# =============================================================================


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _command(args: argparse.Namespace) -> str:
    parts = ["aloe", "eval", "--model", str(args.model)]
    if args.operator:
        parts += ["--operator", str(args.operator)]
    parts += ["--edits", str(args.edits)]
    if args.limit is not None:
        parts += ["--limit", str(args.limit)]
    if args.skip_invalid:
        parts.append("--skip-invalid")
    if args.out:
        parts += ["--out", str(args.out)]
    for b in args.baseline or []:
        parts += ["--baseline", b]
    if args.no_unedited:
        parts.append("--no-unedited")
    if args.layer is not None:
        parts += ["--layer", str(args.layer)]
    parts += ["--batch-size", str(args.batch_size)]
    if args.grace_eps is not None:
        parts += ["--grace-eps", str(args.grace_eps)]
    if args.grace_iters is not None:
        parts += ["--grace-iters", str(args.grace_iters)]
    if args.no_check_fingerprint:
        parts.append("--no-check-fingerprint")
    if args.no_plots:
        parts.append("--no-plots")
    if args.threads is not None:
        parts += ["--threads", str(args.threads)]
    return shlex.join(parts)


def _default_out(args: argparse.Namespace) -> Path:
    stem = Path(args.edits).stem
    model = Path(str(args.model)).name.lower()
    tag = f"_n{args.limit}" if args.limit is not None else ""
    return Path("benchmarks") / "results" / f"eval_{model}_{stem}{tag}"


def _cmd_eval(args: argparse.Namespace) -> int:
    from aloe_kernels import AloeOperator
    from aloe_kernels.errors import AloeError

    from .data import EditDataError, load_edits
    from .models import load_model

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    baselines = [] if args.no_unedited else ["unedited"]
    for b in args.baseline or []:
        if b not in baselines:
            baselines.append(b)
    if not args.operator and baselines == []:
        print("aloe eval: error: nothing to evaluate: give --operator and/or --baseline", file=sys.stderr)
        return 2
    try:
        edits_path = Path(args.edits)
        requests = load_edits(edits_path, args.limit, skip_invalid=args.skip_invalid)
        op = AloeOperator.load(args.operator) if args.operator else None
    except (EditDataError, AloeError, FileNotFoundError) as exc:
        print(f"aloe eval: error: {exc}", file=sys.stderr)
        return 2
    model, tokenizer = load_model(args.model)
    grace_cfg = None
    if "grace" in baselines:
        from .grace import GraceConfig

        kw = {}
        if args.grace_eps is not None:
            kw["eps"] = args.grace_eps
        if args.grace_iters is not None:
            kw["n_iter"] = args.grace_iters
        grace_cfg = GraceConfig(**kw)
    editor = None
    if op is not None:
        if args.layer is not None and op.layer is not None and args.layer != op.layer:
            print(f"aloe eval: error: --layer {args.layer} but the operator was built for layer {op.layer}",
                  file=sys.stderr)
            return 2
        if op.layer is None and args.layer is None:
            print("aloe eval: error: the operator records no layer; pass --layer", file=sys.stderr)
            return 2
        editor = AloeEditor(op, check_fingerprint=not args.no_check_fingerprint,
                            layer=args.layer if op.layer is None else None)
    meta = {
        "data_file": str(edits_path),
        "data_sha256": _sha256(edits_path),
        "data_limit": args.limit,
        "operator_dir": str(args.operator) if args.operator else None,
        "command": _command(args),
        "argv": list(sys.argv),
        "model_arg": str(args.model),
    }
    try:
        report = evaluate(model, tokenizer, requests, editor, batch_size=args.batch_size, progress=not args.quiet,
                          baseline=baselines, layer=args.layer, grace_config=grace_cfg, meta=meta)
    except AloeError as exc:
        print(f"aloe eval: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else _default_out(args)
    paths = report.save(out, plots=not args.no_plots)
    print(report.to_markdown().split("## Definitions")[0].rstrip())
    print()
    for k, p in paths.items():
        print(f"wrote {k}: {p}")
    return 0


def add_eval_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``aloe eval`` on the ``aloe`` command's subparsers; returns the subparser."""
    p = subparsers.add_parser(
        "eval",
        help="score an operator (and baselines) on an edit stream",
        description="Score an ALOE operator on an edit stream with the paper's protocol (greedy exact match), "
        "EasyEdit's teacher-forced token accuracy, and gate diagnostics; compare with the unedited model and "
        "a GRACE reimplementation on the same model, layer and stream. Writes eval_report.json, eval_report.md "
        "and PNG plots.",
    )
    p.add_argument("--model", required=True, help="'smollm2', a local transformers directory, or a .gguf file")
    p.add_argument("--operator", default=None, help="ALOE artifact directory (omit to score baselines only)")
    p.add_argument("--edits", required=True, help="edit file (any format aloe_build.data.load_edits reads)")
    p.add_argument("--limit", type=int, default=None, help="score only the first N edits of the file")
    p.add_argument("--skip-invalid", action="store_true", help="drop invalid records instead of failing")
    p.add_argument("--out", default=None,
                   help="output directory (default benchmarks/results/eval_<model>_<data stem>[_n<limit>])")
    p.add_argument("--baseline", action="append", choices=["grace", "unedited"], default=None,
                   help="also score this baseline on the same model, layer and stream (repeatable); the unedited "
                   "model is always scored unless --no-unedited")
    p.add_argument("--no-unedited", action="store_true", help="do not score the unedited model as a baseline")
    p.add_argument("--layer", type=int, default=None,
                   help="edited layer for baselines (default: the operator's layer, else the model's default)")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per forward pass (default 32)")
    p.add_argument("--grace-eps", type=float, default=None, help="GRACE initial deferral radius (default 1.0)")
    p.add_argument("--grace-iters", type=int, default=None, help="GRACE value-training iterations (default 100)")
    p.add_argument("--no-check-fingerprint", action="store_true",
                   help="apply the operator even if its weight fingerprint does not match the model")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG figures")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=_cmd_eval)
    return p
