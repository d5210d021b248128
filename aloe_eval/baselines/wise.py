"""WISE (Wang et al., 2024, "WISE: Rethinking the Knowledge Memory for Lifelong Model Editing"),
reimplemented after EasyEdit's ``easyeditor/models/wise`` with its ``hparams/WISE/llama-7b.yaml`` values.

Named "WISE (reimplementation)" in reports.

* **Memory.** A side copy of one late MLP down-projection weight takes every edit; the main weight is
  never changed. A router (:mod:`.wise_router`) sends a sequence to the side memory when its activation
  score ``mean_t || act(W_side a_t) - act(W_main a_t) ||`` (``a`` the down-projection input, ``act`` the
  MLP activation, mean over the sequence's tokens in the forward call) reaches
  ``act_ratio`` (0.88) times the smallest in-scope score seen while editing that memory.
* **Training** (:mod:`.wise_train`, inputs :mod:`.wise_inputs`): per edit, the request after the plain
  prompt and 10 prefixes the model generates itself, plus one unrelated statement (edit i gets the
  i-th record of the bundled construction corpus, never an evaluated stream); target loss plus the margins alpha 5 (unrelated
  score below), beta 20 (in-scope score above), gamma 10 (their gap); 70 SGD steps at lr 1.0 at most,
  gradients masked to a random ``mask_ratio`` (0.2) of the weight's entries, one mask per shard.
* **Shards and merging** (``retrieve: true``, the published default): after every ``save_freq`` (500)
  edits the side memory is saved as a shard with its own threshold and a fresh copy of the main weight
  (and a fresh mask) takes the next edits; every ``merge_freq`` (1000) edits the last
  ``merge_freq / save_freq`` shards are merged into one by TIES (:mod:`.wise_merge`, density 0.53,
  weights 1.0 shared among them), its threshold the smallest of theirs. At inference a saved shard answers
  instead when its score beats its own threshold and every score before it. ``replay`` (false in the
  published values) and the merge-only variant (``retrieve: false``) are not implemented.
* **Layer.** EasyEdit's Llama-7B layer is 27 of 32. Here :data:`WISE_LAYER`, 26 of 30, scaled to the
  model's depth by :func:`wise_layer`; chosen on the first 20 CounterFact tuning edits (val records
  1500-1519, one WISE fit per layer with every other value as above, scored by ``aloe_eval.evaluate``) by
  the mean of efficacy, generalization and locality (the WISE paper's summary):

  ========  =========  ===============  ========  ======
  layer     efficacy   generalization   locality  mean
  ========  =========  ===============  ========  ======
  20        0.15       0.00             1.00      0.38
  22        0.15       0.05             0.95      0.38
  24        0.60       0.00             0.35      0.32
  25        0.50       0.00             0.50      0.33
  **26**    0.85       0.00             0.40      0.42
  27        0.70       0.10             0.20      0.33
  29        0.30       0.05             0.15      0.17
  ========  =========  ===============  ========  ======

  Twenty edits leave about 0.1 of noise on each figure. On this model the activation score separates the
  requests poorly from their CounterFact neighbours: at the lower layers few requests reach the threshold
  (layer 22: 6 of 20), at the upper ones the neighbours pass it too (layer 27: 19 of 20), and within one
  shard later edits overwrite earlier ones (the side memory alone gives 12-14 of the 20 targets at
  layers 22-27). The router decides per forward call, so a teacher-forced pass (decided over prompt and
  target) need not route as generation does (decided on the prompt, then on each new token); the
  protocol's efficacy and generalization, which take an all-right teacher-forced row as a hit, matched
  greedy generation with a KV cache at every layer of the table.

Deviations, for batching and CPU budgets: the activation scores average over a row's tokens without its
left padding (the reference's training batch averages over the padding too, whose outputs are far from any
real token's: on SmolLM2 its threshold then lies above every unpadded request's score at inference, where
it runs one unpadded sequence per call); the lower layers' output is computed once per edit instead of
every step (the same numbers, checked once per fit). With the reference's two training averages restricted
to real tokens, its side weight, scores, threshold and routing agree with these bit for bit on three
CounterFact tuning edits. Fitting saves its state under ``$ALOE_CACHE/wise`` every
``checkpoint_every`` edits and resumes there.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Sequence

from torch import nn

from aloe_build.checkpoints import run_key
from aloe_kernels import weight_fingerprint
from aloe_kernels.hf import locate_down_proj

from ..content_key import content_key
from ..editors import Editor
from .peak_memory import peak_memory_mb
from .wise_checkpoint import WiseCheckpoint, WiseState
from .wise_router import LONG_SEQUENCE, WiseDownProj

__all__ = ["WISE_CACHE", "WiseConfig", "WiseEditor", "fit_wise", "wise_layer"]

NAME = "WISE (reimplementation)"
#: Directory under ALOE's cache root where ``aloe eval --baseline wise`` saves its fits as they go.
WISE_CACHE = "wise"
#: Bump when what fitting an edit computes changes (it keys the saved fits).
FIT_FORMAT = 1
#: The side memory's layer on a model of WISE_DEPTH layers (see the module docstring).
WISE_LAYER, WISE_DEPTH = 26, 30


@dataclasses.dataclass(frozen=True)
class WiseConfig:
    """WISE's hyperparameters (defaults: EasyEdit's ``hparams/WISE/llama-7b.yaml``; ``act_margin`` is
    ``[alpha, beta, gamma]``, ``weights`` and ``densities`` are ``merge_weight`` and ``density``)."""

    layer: int | None = None  # None: WISE_LAYER scaled to the model's depth (wise_layer)
    edit_lr: float = 1.0
    n_iter: int = 70
    mask_ratio: float = 0.2
    alpha: float = 5.0
    beta: float = 20.0
    gamma: float = 10.0
    act_ratio: float = 0.88
    norm_constraint: float | None = 1.0
    save_freq: int = 500
    merge_freq: int = 1000
    density: float = 0.53
    merge_weight: float = 1.0
    weight_decay: float = 1e-5  # the reference's SGD weight decay (fixed in its code)
    long_sequence: int = LONG_SEQUENCE
    seed: int = 0

    def __post_init__(self) -> None:
        if self.merge_freq % self.save_freq:
            raise ValueError("merge_freq must be a multiple of save_freq (as the reference requires)")


def wise_layer(model: nn.Module) -> int:
    """:data:`WISE_LAYER` of 30 at the model's depth."""
    from aloe_build.models import num_decoder_layers

    n = num_decoder_layers(model)
    return min(n - 1, int(WISE_LAYER * n / WISE_DEPTH + 0.5))


def activation(model: nn.Module):
    """The model's MLP activation (``config.hidden_act``, GPT-2's ``activation_function``) and its name."""
    from transformers.activations import ACT2FN

    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    name = getattr(config, "hidden_act", None) or getattr(config, "activation_function", None) or "silu"
    return ACT2FN[name], name


class WiseEditor(Editor):
    """A fitted WISE memory for one layer; attach/detach swap the down-projection for the router (the
    design, the defaults and the tuning rows of the layer are in the module docstring)."""

    def __init__(self, layer: int, state: WiseState, cfg: WiseConfig, act_name: str, info: dict[str, Any]):
        self.name = NAME
        self.layer = layer
        self.state = state
        self.cfg = cfg
        self.act_name = act_name
        self._info = info
        self._hook = None

    @property
    def thresholds(self) -> tuple[float, list[float]]:
        """(the side memory's threshold, each saved memory's): act_ratio times their smallest in-scope score."""
        r = self.cfg.act_ratio
        return r * self.state.side_min, [r * m for m in self.state.memory_mins]

    def router(self, base: nn.Module, device) -> WiseDownProj:
        """The routing module around ``base`` (the layer's down-projection), its memories on ``device``."""
        from transformers.activations import ACT2FN

        side_t, mem_t = self.thresholds
        memories = [m.to(device) for m in self.state.memories]
        act = ACT2FN[self.act_name]
        return WiseDownProj(base, self.state.side.to(device), side_t, memories, mem_t, act, self.cfg.long_sequence)

    def attach(self, model: nn.Module) -> None:
        site = locate_down_proj(model, self.layer)
        if isinstance(site.module, WiseDownProj):
            raise RuntimeError(f"{site.path} already carries a WISE memory")
        wrapper = self.router(site.module, site.weight().device)
        setattr(site.parent, site.attr, wrapper)
        self._hook = model.register_forward_pre_hook(wrapper.mask_hook, with_kwargs=True)

    def detach(self, model: nn.Module) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        for name, m in list(model.named_modules()):
            if isinstance(m, WiseDownProj):
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, attr, m.base)

    def info(self) -> dict[str, Any]:
        return dict(self._info)

    def state_key(self) -> str:
        # the router answers from its weights, thresholds, activation and long-sequence rule alone
        s = self.state
        weights = [weight_fingerprint(t) for t in [s.side, *s.memories]]
        return content_key([NAME, self.layer, self.act_name, weights, list(self.thresholds), self.cfg.long_sequence])


def unrelated_statements() -> list[str]:
    """The out-of-scope rows: each record of the bundled construction corpus as "prompt answer"."""
    from aloe_build import load_edits
    from aloe_build.corpus import default_corpus_path

    records = load_edits(default_corpus_path())
    return [f"{r.prompt} {r.ground_truth[0] if r.ground_truth else r.target_new}".strip() for r in records]


def fit_wise(
    model: nn.Module,
    tokenizer,
    requests: Sequence[Any],
    config: WiseConfig = WiseConfig(),
    *,
    progress: bool = False,
    checkpoint_dir: str | Path | None = None,
    checkpoint_every: int = 10,
    unrelated: Sequence[str] | None = None,
    prefixes: Sequence[str] | None = None,
) -> WiseEditor:
    """Fit WISE on ``requests`` in stream order; the model is left unpatched on return.

    ``unrelated``: the out-of-scope statements, edit i trains against the ``i % len``-th (default
    :func:`unrelated_statements`); ``prefixes``: the context prefixes (default
    :func:`.wise_inputs.context_prefixes`, cached under ``checkpoint_dir``). With ``checkpoint_dir`` the
    state is saved there every ``checkpoint_every`` edits and at the end, under a key of the requests,
    the weight, the layer, ``config``, the prefixes and the statements; a rerun resumes after the last
    saved edit (the info's ``resumed_edits`` says how many were read back)."""
    from .wise_fit import run_fit

    t0 = time.perf_counter()
    layer = wise_layer(model) if config.layer is None else config.layer
    if prefixes is None:
        from .wise_inputs import context_prefixes

        prefixes = context_prefixes(model, tokenizer, checkpoint_dir)
    texts = list(unrelated) if unrelated is not None else unrelated_statements()
    site = locate_down_proj(model, layer)
    main = site.weight().detach().float().clone()
    used = [texts[i % len(texts)] for i in range(len(requests))]
    key = content_key(
        [run_key(requests, weight_fingerprint(main), layer), FIT_FORMAT, dataclasses.asdict(config), list(prefixes), used]
    )
    saves = WiseCheckpoint(checkpoint_dir, layer, key)
    state = saves.restore() or WiseState(side=main.clone())
    resumed = state.done
    act, act_name = activation(model)
    upper_used = run_fit(
        model, tokenizer, requests, layer, config, state, list(prefixes), used, act, saves, checkpoint_every, progress
    )
    log = state.log
    scores = [e["score"] for e in log]
    info = {
        "kind": "wise",
        "layer": layer,
        "module_path": site.path,
        "config": dataclasses.asdict(config),
        "edits": len(requests),
        "prefixes": list(prefixes),
        "activation": act_name,
        "memories": len(state.memories),
        "thresholds": {"side": config.act_ratio * state.side_min, "memories": [config.act_ratio * m for m in state.memory_mins]},
        "in_scope_score": _stats(scores),
        "unrelated_score": _stats([e["score_out"] for e in log]),
        "steps": _stats([e["steps"] for e in log]),
        "target_loss_last": _stats([e["target_loss_last"] for e in log]),
        "lower_layers_once": upper_used,
        "fit_s": time.perf_counter() - t0,
        "resumed_edits": resumed,
        "peak_memory_mb": peak_memory_mb(),
    }
    return WiseEditor(layer, state, config, act_name, info)


def _stats(xs: list[float]) -> dict[str, float]:
    finite = [x for x in xs if math.isfinite(x)]
    if not finite:
        return {"min": math.nan, "mean": math.nan, "max": math.nan}
    return {"min": min(finite), "mean": sum(finite) / len(finite), "max": max(finite)}
