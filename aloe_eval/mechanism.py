"""The address-mechanism study: the stage-1 objective on held-out items, over seeds, against the
equal-dimension raw-activation control (protocols and metrics: :mod:`aloe_build.mechanism`).

Partitions are fixed by the config's seed; each seed trains a fresh encoder on the training part.
"""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Sequence

import torch

from aloe_build.config import BuildConfig
from aloe_build.corpus import Corpus
from aloe_build.data import load_edits
from aloe_build.encoder import CorpusStates, corpus_states
from aloe_build.mechanism import PROTOCOLS, Partition, dev_key_states, partition, protocol_metrics

PAPER_DEV_ITEMS = 632  # the paper's development set size
PAPER_SEEDS = (0, 42, 99)
HEADLINE = ("scope_auc", "recall", "same_subject_top1", "negative_fpr")


def _summary(runs: list[dict[str, float]]) -> dict[str, dict]:
    """Mean, standard deviation and per-seed values of each metric."""
    out = {}
    for key in runs[0]:
        values = [r[key] for r in runs]
        out[key] = {"mean": statistics.fmean(values), "std": statistics.pstdev(values), "per_seed": values}
    return out


def _describe(corpus: Corpus, part: Partition) -> dict:
    return {"train": len(part.train), "calibration": len(part.calibration), "dev": len(part.dev),
            "dev_relations": len({corpus.items[i].group for i in part.dev})}


def study_from_states(cs: CorpusStates, corpus: Corpus, parts: dict[str, Partition],
                      keys: dict[str, torch.Tensor | None], cfg: BuildConfig, seeds: Sequence[int]) -> dict:
    """Each protocol's learned and raw-control metrics over ``seeds`` (states already collected)."""
    out: dict = {"seeds": list(seeds)}
    for protocol, part in parts.items():
        runs = [protocol_metrics(cs, corpus, part, keys[protocol], dataclasses.replace(cfg, seed=s)) for s in seeds]
        out[protocol] = {"parts": _describe(corpus, part),
                         **{kind: _summary([r[kind] for r in runs]) for kind in ("learned", "raw_control")}}
    return out


def mechanism_study(model, tokenizer, corpus_path: str | Path, layer: int, cfg: BuildConfig | None = None,
                    seeds: Sequence[int] = PAPER_SEEDS, dev_items: int = PAPER_DEV_ITEMS,
                    protocols: Sequence[str] = PROTOCOLS) -> dict:
    """Run the study on a CounterFact-style file (e.g. CounterFact train) at ``layer``."""
    cfg = cfg or BuildConfig()
    corpus = Corpus(load_edits(corpus_path), cfg.encoder_same_subject, cfg.seed)
    parts = {p: partition(corpus, p, dev_items, cfg.seed) for p in protocols}
    cs = corpus_states(model, tokenizer, corpus, layer, cfg.batch_size)
    keys = {p: dev_key_states(model, tokenizer, corpus, part, layer, cfg) for p, part in parts.items()}
    out = study_from_states(cs, corpus, parts, keys, cfg, seeds)
    out.update(corpus=str(corpus_path), items=len(corpus.items), relations=len(corpus.templates), layer=layer)
    return out


def mechanism_markdown(study: dict) -> str:
    """A table per protocol: mean ± std over seeds, learned vs raw control."""
    lines = []
    for protocol in PROTOCOLS:
        if protocol not in study:
            continue
        p = study[protocol]["parts"]
        lines += [f"### {protocol} protocol (train {p['train']}, calibration {p['calibration']}, "
                  f"development {p['dev']} over {p['dev_relations']} relations)", "",
                  "| encoder | " + " | ".join(HEADLINE) + " |", "|---" * (len(HEADLINE) + 1) + "|"]
        for kind in ("learned", "raw_control"):
            m = study[protocol][kind]
            cells = [f"{m[k]['mean']:.3f} ± {m[k]['std']:.3f}" if k in m else "n/a" for k in HEADLINE]
            lines.append(f"| {kind} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)
