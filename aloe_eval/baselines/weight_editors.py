"""The weight editors by name, as ``aloe eval --baseline rome|memit|alphaedit`` fits them: each with its
recorded settings, the second moments of its layers over the bundled construction corpus (never an
evaluated stream), and every target value cached under ``$ALOE_CACHE/weight-edits`` so that a rerun
resumes where the last one stopped."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from .peak_memory import peak_memory_mb
from .weight_delta import WeightDeltaEditor

#: the names ``--baseline`` accepts for the weight editors
WEIGHT_EDITORS = ("rome", "memit", "alphaedit")
#: corpus statements whose down-projection inputs give the second moments
SECOND_MOMENT_RECORDS = 2000
#: the layer ROME edits on a model of about 30 layers (its Llama-7B layer, 5 of 32, scaled)
ROME_LAYER = 4


def weight_edit_cache() -> Path:
    """Where second moments, context prefixes and target values are kept."""
    from aloe_build.models import cache_root

    return cache_root() / "weight-edits"


def corpus_second_moments(model: nn.Module, tokenizer, layers: Sequence[int]) -> dict:
    """The second moment of each layer's down-projection input over the bundled corpus (cached)."""
    from aloe_build import load_edits
    from aloe_build.corpus import default_corpus_path

    from .second_moments import cached_second_moment

    corpus = load_edits(default_corpus_path(), limit=SECOND_MOMENT_RECORDS)
    texts = [f"{r.prompt} {r.ground_truth or ''}".strip() for r in corpus]
    return {layer: cached_second_moment(model, tokenizer, texts, layer, weight_edit_cache()) for layer in layers}


def fit_weight_editor(
    kind: str, model: nn.Module, tokenizer, requests: Sequence[Any], progress: bool = False
) -> WeightDeltaEditor:
    """ROME (sequential, one edit at a time, at :data:`ROME_LAYER`, on the plain prompt), MEMIT (one
    batch) or AlphaEdit (sequential batches of 100) fitted on ``requests``; the model is left as it was.
    The editor's info records its settings, the fit time and the process's peak memory."""
    from .context_prefixes import MEMIT_LENGTHS, prefix_groups

    kind = kind.lower()
    t0 = time.perf_counter()
    cache = weight_edit_cache()
    if kind == "rome":
        from .rome import fit_rome

        C = corpus_second_moments(model, tokenizer, [ROME_LAYER])[ROME_LAYER]
        editor = fit_rome(model, tokenizer, requests, ROME_LAYER, C, cache, progress=progress)
    elif kind in ("memit", "alphaedit"):
        from .alphaedit import AlphaEditSettings, fit_alphaedit
        from .memit import MemitSettings, fit_memit

        settings = MemitSettings() if kind == "memit" else AlphaEditSettings()
        moments = corpus_second_moments(model, tokenizer, settings.layers)
        groups = prefix_groups(model, tokenizer, MEMIT_LENGTHS, cache)
        fit = fit_memit if kind == "memit" else fit_alphaedit
        editor = fit(model, tokenizer, requests, moments, groups, cache, settings, progress=progress)
    else:
        raise ValueError(f"unknown weight editor {kind!r}: expected one of {', '.join(WEIGHT_EDITORS)}")
    seconds = time.perf_counter() - t0
    editor._info.update(fit_seconds=seconds, seconds_per_edit=seconds / max(1, len(requests)), peak_memory_mb=peak_memory_mb())
    return editor
