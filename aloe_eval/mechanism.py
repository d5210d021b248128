"""The address-mechanism study: the stage-1 objective on held-out items, over seeds, against the
equal-dimension raw-activation control (protocols and metrics: :mod:`aloe_build.mechanism_protocol`).

Partitions are fixed by the config's seed; each seed trains a fresh encoder on the training part.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Sequence

import torch

from aloe_build.checkpoints import file_sha256, save_tensors_atomically
from aloe_build.config import BuildConfig
from aloe_build.corpus import CORPUS_VERSION, Corpus
from aloe_build.data import load_edits
from aloe_build.mechanism_protocol import FPR_BUDGET, PROTOCOLS, Partition, dev_key_states, partition, protocol_metrics
from aloe_build.stages.s1_encoder import CorpusStates, corpus_states
from aloe_kernels import weight_fingerprint
from aloe_kernels.hf import locate_down_proj

PAPER_DEV_ITEMS = 632  # the paper's development set size
PAPER_SEEDS = (0, 42, 99)
# the paper's four metrics, then recall and FPR under the fixed-budget threshold rule
HEADLINE = ("scope_auc", "recall", "same_subject_top1", "negative_fpr", "recall_at_budget", "negative_fpr_at_budget")


def _summary(runs: list[dict[str, float]]) -> dict[str, dict]:
    """Mean, standard deviation and per-seed values of each metric."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "per_seed": values}
    return out


def _describe(corpus: Corpus, part: Partition) -> dict:
    return {
        "train": len(part.train),
        "calibration": len(part.calibration),
        "dev": len(part.dev),
        "dev_relations": len({corpus.items[i].group for i in part.dev}),
    }


def study_from_states(
    cs: CorpusStates,
    corpus: Corpus,
    parts: dict[str, Partition],
    keys: dict[str, torch.Tensor | None],
    cfg: BuildConfig,
    seeds: Sequence[int],
) -> dict:
    """Each protocol's learned and raw-control metrics over ``seeds`` (states already collected)."""
    out: dict = {"seeds": list(seeds)}
    for protocol, part in parts.items():
        runs = [protocol_metrics(cs, corpus, part, keys[protocol], dataclasses.replace(cfg, seed=s)) for s in seeds]
        out[protocol] = {
            "parts": _describe(corpus, part),
            **{kind: _summary([r[kind] for r in runs]) for kind in ("learned", "raw_control")},
        }
    return out


def _states_identity(
    model, corpus_path: str | Path, layer: int, cfg: BuildConfig, dev_items: int, protocols: Sequence[str]
) -> dict:
    """What the collected states depend on: a states file made for another identity is not reused."""
    site = locate_down_proj(model, layer)
    return {
        "weight": weight_fingerprint(site.weight()),
        "layer": layer,
        "corpus_sha256": file_sha256(corpus_path),
        "corpus_version": CORPUS_VERSION,
        "same_subject": cfg.encoder_same_subject,
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "dev_items": dev_items,
        "protocols": sorted(protocols),
    }


def _save_states(path: Path, identity: dict, cs: CorpusStates, keys: dict[str, torch.Tensor | None]) -> None:
    tensors = {f"cs.{f.name}": getattr(cs, f.name).contiguous() for f in dataclasses.fields(cs)}
    tensors.update({f"keys.{p}": k.contiguous() for p, k in keys.items() if k is not None})
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tensors_atomically(tensors, path, metadata={"identity": json.dumps(identity, sort_keys=True)})


def _load_states(path: Path, identity: dict, protocols: Sequence[str]):
    """The states saved at ``path`` for ``identity``, or None (and why) when they are not those."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(str(path), framework="pt") as f:
        saved = json.loads((f.metadata() or {}).get("identity", "{}"))
    if saved != identity:
        differ = sorted(k for k in set(saved) | set(identity) if saved.get(k) != identity.get(k))
        return None, f"made for another {', '.join(differ)}"
    t = load_file(str(path))
    cs = CorpusStates(*(t[f"cs.{f.name}"] for f in dataclasses.fields(CorpusStates)))
    return (cs, {p: t.get(f"keys.{p}") for p in protocols}), ""


def mechanism_study(
    model,
    tokenizer,
    corpus_path: str | Path,
    layer: int,
    cfg: BuildConfig | None = None,
    seeds: Sequence[int] = PAPER_SEEDS,
    dev_items: int = PAPER_DEV_ITEMS,
    protocols: Sequence[str] = PROTOCOLS,
    states_path: str | Path | None = None,
) -> dict:
    """Run the study on a CounterFact-style file (e.g. CounterFact train) at ``layer``. With
    ``states_path`` the collected states are read from there when they were made for the same model
    weight, layer, corpus and partitions, and written there otherwise, so that stage-1 settings can
    be compared in seconds each."""
    cfg = cfg or BuildConfig()
    corpus = Corpus(load_edits(corpus_path), cfg.encoder_same_subject, cfg.seed)
    parts = {p: partition(corpus, p, dev_items, cfg.seed) for p in protocols}
    identity = _states_identity(model, corpus_path, layer, cfg, dev_items, protocols)
    loaded, why = (None, "none yet")
    if states_path is not None and Path(states_path).is_file():
        loaded, why = _load_states(Path(states_path), identity, protocols)
    if loaded is not None:
        cs, keys = loaded
    else:
        if states_path is not None:
            print(f"collecting states ({Path(states_path)}: {why})")
        cs = corpus_states(model, tokenizer, corpus, layer, cfg.batch_size)
        keys = {p: dev_key_states(model, tokenizer, corpus, part, layer, cfg) for p, part in parts.items()}
        if states_path is not None:
            _save_states(Path(states_path), identity, cs, keys)
    out = study_from_states(cs, corpus, parts, keys, cfg, seeds)
    out.update(corpus=str(corpus_path), items=len(corpus.items), relations=len(corpus.templates), layer=layer)
    return out


def mechanism_markdown(study: dict) -> str:
    """A table per protocol: mean ± std over seeds, learned vs raw control."""
    lines = [
        f"`recall` and `negative_fpr` at the threshold maximizing calibration recall minus FPR; the `_at_budget` "
        f"pair at the lowest threshold with calibration FPR ≤ {FPR_BUDGET}.",
        "",
    ]
    for protocol in PROTOCOLS:
        if protocol not in study:
            continue
        p = study[protocol]["parts"]
        lines += [
            f"### {protocol} protocol (train {p['train']}, calibration {p['calibration']}, "
            f"development {p['dev']} over {p['dev_relations']} relations)",
            "",
            "| encoder | " + " | ".join(HEADLINE) + " |",
            "|---" * (len(HEADLINE) + 1) + "|",
        ]
        for kind in ("learned", "raw_control"):
            m = study[protocol][kind]
            cells = [f"{m[k]['mean']:.3f} ± {m[k]['std']:.3f}" if k in m else "n/a" for k in HEADLINE]
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)
