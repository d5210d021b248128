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

Entry points: :func:`evaluate` (API) and ``aloe eval``.
"""

from __future__ import annotations

import datetime as _dt
import os
import platform
import sys
import time
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from aloe_build.forward import model_device
from aloe_build.models import default_layer, model_name
from aloe_build.tokens import pad_id as tokenizer_pad_id
from aloe_build.tokens import stop_ids
from aloe_kernels.hf import find_aloe_modules

from .baselines.weight_editors import WEIGHT_EDITORS
from .chunks import ChunkStore, chunk_bounds, chunk_key, merge_results
from .definitions import LOCALITY_DEFAULT_TOKENS, LOCALITY_MAX_TOKENS, PORTABILITY_MAX_TOKENS
from .editors import AloeEditor, Editor, ToldEditor, UneditedEditor, as_editor
from .plan import plan
from .report import EditorResult, EvalReport, jsonable
from .scoring import build_reference, score_editor, told_inputs


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
    chunk_edits: int | None = None,
    parts_dir: str | os.PathLike | None = None,
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
        baseline: further editors on the same model, layer and stream: ``"unedited"``, ``"told"``
            (the unedited model told each fact first, :class:`ToldEditor`), ``"grace"``, ``"rome"``,
            ``"memit"``, ``"alphaedit"``, ``"ft-m"``, ``"wise"`` (:mod:`aloe_eval.baselines`, fitted
            here on ``requests``), an :class:`Editor`, or a list of these.
        layer: the edited layer for baselines (default: the operator's layer,
            else ``aloe_build.models.default_layer(model)``).
        open_threshold: a gate counts as open at or above this value.
        grace_config: an ``aloe_eval.baselines.grace.GraceConfig`` for ``"grace"``.
        meta: extra metadata for the report (data file, its hash, command).
        chunk_edits: score the stream this many edits at a time (None: in one pass); the
            numbers are the same (see :mod:`aloe_eval.chunks`).
        parts_dir: where each chunk's results are saved as it finishes; an evaluation that
            finds a chunk there with the same edits, editors and settings reads it back.

    Each editor is patched in, scored, and removed again; the model is left
    as it came. The unedited model's locality generations are computed once
    and shared by all editors.
    """
    if find_aloe_modules(model):
        raise ValueError("the model already carries an ALOE patch; pass the unpatched model and the operator")
    requests = list(requests)
    if not requests:
        raise ValueError("no edit requests to evaluate")
    t_start = time.perf_counter()
    primary = as_editor(op, layer) if op is not None else None
    layer = edited_layer(model, primary, layer)
    timings: dict[str, float] = {}
    editors = _editors(model, tokenizer, requests, primary, baseline, layer, grace_config, batch_size, progress, timings)
    names = [e.name for e in editors]
    context = _chunk_context(model, names, primary, layer, open_threshold, grace_config)
    results, sequences, chunks = _score_in_chunks(
        model,
        tokenizer,
        requests,
        editors,
        context,
        chunk_edits,
        parts_dir,
        batch_size=batch_size,
        progress=progress,
        open_threshold=open_threshold,
        timings=timings,
    )
    timings["total_s"] = time.perf_counter() - t_start
    m = _meta(model, layer, len(requests), names, batch_size, open_threshold, timings, sequences)
    if chunks > 1:
        m["settings"]["chunk_edits"] = chunk_edits
    if isinstance(primary, AloeEditor):
        m["operator_hash"] = primary.op.fingerprint()
        m["operator_n"] = primary.op.n
    if meta:
        m.update(dict(meta))
    return EvalReport(jsonable(m), results, names[0])


def edited_layer(model, primary: Editor | None, layer: int | None) -> int:
    """The layer the baselines edit: ``layer`` when given, else the editor under test's, else the
    model's default (so that every editor is compared on the same layer)."""
    if layer is None:
        layer = primary.layer if primary is not None and primary.layer is not None else None
    if layer is None:
        layer = default_layer(model)
    return layer


def _chunk_context(
    model, names: list[str], primary: Editor | None, layer: int, open_threshold: float, grace_config: Any
) -> dict[str, Any]:
    """Everything besides the edits that a saved chunk's results depend on: a chunk saved under a
    different context is scored again rather than read back."""
    return {
        "editors": names,
        "layer": layer,
        "open_threshold": open_threshold,
        "grace": repr(grace_config),
        "operator": primary.op.fingerprint() if isinstance(primary, AloeEditor) else None,
        "write_positions": primary.write_positions if isinstance(primary, AloeEditor) else None,
        "dtype": str(next(model.parameters()).dtype),
    }


def _score_in_chunks(
    model,
    tokenizer,
    requests: list,
    editors: list[Editor],
    context: dict[str, Any],
    chunk_edits: int | None,
    parts_dir,
    *,
    batch_size: int,
    progress: bool,
    open_threshold: float,
    timings: dict[str, float],
) -> tuple[dict[str, EditorResult], int, int]:
    """Every editor scored on the stream, ``chunk_edits`` edits at a time, each chunk read back
    from or saved to ``parts_dir``; returns the merged results, the sequences scored in this call
    and the number of chunks."""
    store = ChunkStore(parts_dir) if parts_dir is not None else None
    bounds = chunk_bounds(len(requests), chunk_edits)
    pieces: list[dict[str, EditorResult]] = []
    sequences = 0
    for k, (lo, hi) in enumerate(bounds):
        key = chunk_key(requests[lo:hi], lo, context)
        piece = store.get(k, key) if store is not None else None
        if piece is None:
            if progress and len(bounds) > 1:
                print(f"evaluation: chunk {k + 1}/{len(bounds)} (edits {lo}-{hi - 1})", file=sys.stderr)
            piece, n = _score_chunk(
                model,
                tokenizer,
                requests[lo:hi],
                lo,
                editors,
                batch_size=batch_size,
                progress=progress,
                open_threshold=open_threshold,
                timings=timings,
            )
            sequences += n
            if store is not None:
                store.put(k, key, piece)
        pieces.append(piece)
    results = {
        ed.name: merge_results([p[ed.name] for p in pieces], slots=ed.has_slots, open_threshold=open_threshold) for ed in editors
    }
    for ed in editors:  # fitted once for all the chunks (and not again for a chunk read back)
        if ed.fit_seconds is not None:
            info = results[ed.name].info
            info["timings"] = {"fit_s": ed.fit_seconds, **info["timings"]}
    return results, sequences, len(bounds)


def _score_chunk(
    model,
    tokenizer,
    requests: list,
    start: int,
    editors: list[Editor],
    *,
    batch_size: int,
    progress: bool,
    open_threshold: float,
    timings: dict[str, float],
) -> tuple[dict[str, EditorResult], int]:
    """Every editor scored on the edits ``requests`` (from position ``start`` of the stream); returns
    the results by editor name and the number of sequences scored."""
    pad, stops = tokenizer_pad_id(tokenizer), stop_ids(tokenizer)
    reg, plans = plan(tokenizer, requests, start=start)
    ref = build_reference(model, reg, plans, pad_id=pad, stops=stops, batch_size=batch_size, progress=progress, timings=timings)
    inputs = {False: (reg, plans, ref)}
    if any(isinstance(ed, ToldEditor) for ed in editors):
        # the told control asks other prompts (each after its edit's statement): a plan of its own
        inputs[True] = told_inputs(tokenizer, reg, plans, ref)
    piece = {
        ed.name: score_editor(
            model,
            tokenizer,
            ed,
            *inputs[isinstance(ed, ToldEditor)],
            pad_id=pad,
            batch_size=batch_size,
            progress=progress,
            open_threshold=open_threshold,
        )
        for ed in editors
    }
    return piece, sum(len(r.seqs) for r, _, _ in inputs.values())


def _editors(
    model,
    tokenizer,
    requests: list,
    primary: Editor | None,
    baseline,
    layer: int,
    grace_config: Any,
    batch_size: int,
    progress: bool,
    timings: dict[str, float],
) -> list[Editor]:
    """The editor under test followed by the baselines (the unedited model when nothing else is asked)."""
    if baseline is None:
        bl: list = []
    elif isinstance(baseline, (str, Editor)):
        bl = [baseline]
    else:
        bl = list(baseline)
    editors: list[Editor] = [primary] if primary is not None else []
    for b in bl:
        if isinstance(b, Editor):
            editors.append(b)
            continue
        e = fit_baseline(str(b), model, tokenizer, requests, layer, grace_config, batch_size, progress)
        if e.fit_seconds is not None:
            timings[f"{str(b).lower()}_fit_s"] = e.fit_seconds
        editors.append(e)
    if not editors:
        editors = [UneditedEditor(layer)]
    names = [e.name for e in editors]
    if len(set(names)) != len(names):
        raise ValueError(f"editor names must be distinct, got {names}")
    return editors


def fit_baseline(
    name: str,
    model,
    tokenizer,
    requests: Sequence[Any],
    layer: int,
    grace_config: Any = None,
    batch_size: int = 32,
    progress: bool = False,
) -> Editor:
    """The baseline ``name`` ready to attach: ``"unedited"``, ``"told"`` (the unedited model asked each
    prompt after its edit's statement), or ``"grace"`` (at ``layer``), a weight editor, ``"ft-m"`` or
    ``"wise"`` (each on its own layers) fitted on ``requests``, its fitting time in ``fit_seconds``."""
    key = name.lower()
    t = time.perf_counter()
    if key in ("unedited", "none", "base"):
        return UneditedEditor(layer)
    if key == "told":  # nothing to fit: the unedited model, told each fact in its prompts
        return ToldEditor(layer)
    if key == "grace":
        from aloe_build.models import cache_root

        from .baselines.grace import GRACE_CACHE, GraceConfig, fit_grace

        cfg = grace_config or GraceConfig()
        editor: Editor = fit_grace(
            model,
            tokenizer,
            list(requests),
            layer,
            cfg,
            batch_size=min(batch_size, 16),
            progress=progress,
            checkpoint_dir=cache_root() / GRACE_CACHE,
        )
    elif key in WEIGHT_EDITORS:
        from .baselines.weight_editors import fit_weight_editor

        editor = fit_weight_editor(key, model, tokenizer, requests, progress=progress)
    elif key == "ft-m":
        from aloe_build.models import cache_root

        from .baselines.ft_m import FTM_CACHE, fit_ft_m

        editor = fit_ft_m(model, tokenizer, list(requests), progress=progress, checkpoint_dir=cache_root() / FTM_CACHE)
    elif key == "wise":
        from aloe_build.models import cache_root

        from .baselines.wise import WISE_CACHE, fit_wise

        editor = fit_wise(model, tokenizer, list(requests), progress=progress, checkpoint_dir=cache_root() / WISE_CACHE)
    else:
        known = ", ".join(map(repr, ("unedited", "told", "grace", *WEIGHT_EDITORS, "ft-m", "wise")))
        raise ValueError(f"unknown baseline {name!r}: expected one of {known} or an Editor")
    editor.fit_seconds = time.perf_counter() - t
    return editor


def _meta(
    model,
    layer: int,
    n_edits: int,
    names: list[str],
    batch_size: int,
    open_threshold: float,
    timings: dict[str, float],
    unique_sequences: int,
) -> dict[str, Any]:
    """What the report records of the model, the settings, the software and the host."""
    import transformers

    return {
        "model": model_name(model),
        "model_class": type(model).__name__,
        "layer": layer,
        "n_edits": n_edits,
        "editors": names,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": {
            "batch_size": batch_size,
            "open_threshold": open_threshold,
            "locality_max_tokens": LOCALITY_MAX_TOKENS,
            "locality_default_tokens": LOCALITY_DEFAULT_TOKENS,
            "portability_max_tokens": PORTABILITY_MAX_TOKENS,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
            "device": str(model_device(model)),
        },
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__},
        "host": {"cpu_threads": torch.get_num_threads(), "platform": platform.platform()},
        "timings": timings,
        "unique_sequences": unique_sequences,
    }
