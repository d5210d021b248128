"""Can an address learned on the question's pooled span open on held-out rewordings and requests in
context, and stay shut on the same subject's other relations, neighbours and the edit's statement?

:mod:`.span_states` measures the raw geometry; this fits the address. For each reading point of
:mod:`.span_states` at each layer, one linear address per edit of the tuning slice is trained (logistic,
all edits jointly) on construction data only, as a build would: positives are the request, the request
after 4 corpus statements and the request's relation under up to 8 other corpus templates (rewordings the
build can make); negatives are the subject under 8 other relations, the template with 8 other subjects,
the edit's statement then 4 other questions, the other edits' positives and a shared pool of corpus
prompts. Each gate opens above the midpoint between its worst training positive and its worst training
negative. Scored on the slice's held-out prompts (:mod:`.scope_prompts`): the share of requests,
rewordings, requests after held-out sentences and after another edit's statement whose own gate opens, and
the share of prompts asking no edit's fact (the edit's statement then another question, the same subject
asked another relation, the neighbours) where no gate opens, and where the gate of the edit they belong to
opens (after its statement, on its subject, on its neighbour). The address alone: no write is fitted.

    python -m experiments.span_address_fit --edits $DATA/counterfact/counterfact-val.json --start 1500 \\
        --n 100 --layers 8 22 --out FILE.json
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from aloe_build import load_edits
from aloe_build.corpus import load_corpus
from aloe_build.data import fact_statement
from aloe_build.models import load_model

from .scope_prompts import save_result, scope_prompts, slice_parser
from .span_states import READINGS, asked_edit, span_readings

#: corpus prompts in the shared negative pool (requests, rewordings and locality prompts of corpus records)
SHARED_RECORDS = 1000


def training_prompts(edits, corpus, seed: int = 0) -> tuple[list[str], list[int]]:
    """Texts, and per text the edit it is a positive of (-1: a negative of every edit)."""
    rng = random.Random(seed)
    texts, pos_of = [], []

    def add(items, pos: int) -> None:
        for t in items:
            texts.append(t)
            pos_of.append(pos)

    for i, e in enumerate(edits):
        template = e.template
        group = corpus.group_of_template.get(template) if template else None
        add([e.prompt, *corpus.prefixed_prompts(e.prompt, 4, rng)], i)
        if template:
            add(corpus.same_relation_prompts(template, e.subject, 8, rng), i)
            others = corpus.other_subject_prompts(template, e.subject, 8, rng)
            add(others, -1)
            add([f"{fact_statement(e.prompt, e.target_new)} {q}" for q in others[:4]], -1)
        if group is not None:
            add(corpus.other_relation_prompts(e.subject, group, 8, rng), -1)
    for it in corpus.items[:SHARED_RECORDS]:
        add([it.request, it.paraphrase, it.locality], -1)
    return texts, pos_of


def fit_addresses(x: torch.Tensor, pos_of: list[int], n_edits: int, steps: int = 300, decay: float = 1e-4):
    """Per edit a linear address (weights, bias) and its gate threshold; logistic loss with the positives
    and the negatives of each edit weighted equally."""
    y = torch.zeros(len(pos_of), n_edits, dtype=x.dtype)
    for k, i in enumerate(pos_of):
        if i >= 0:
            y[k, i] = 1.0
    w_pos = 0.5 / y.sum(0).clamp(min=1)
    w_neg = 0.5 / (1 - y).sum(0)
    weight = y * w_pos + (1 - y) * w_neg
    W = torch.zeros(x.shape[1], n_edits, dtype=x.dtype, requires_grad=True)
    b = torch.zeros(n_edits, dtype=x.dtype, requires_grad=True)
    opt = torch.optim.LBFGS([W, b], lr=1, max_iter=steps, line_search_fn="strong_wolfe")
    scale = 10.0  # unit states: logits need room to reach saturation

    def closure():
        opt.zero_grad()
        logits = scale * (x @ W) + b
        loss = (F.binary_cross_entropy_with_logits(logits, y, reduction="none") * weight).sum() / n_edits
        loss = loss + decay * (W**2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        s = scale * (x @ W) + b
        worst_pos = torch.where(y > 0, s, torch.full_like(s, float("inf"))).min(0).values
        worst_neg = torch.where(y > 0, torch.full_like(s, -float("inf")), s).max(0).values
        threshold = (worst_pos + worst_neg) / 2
    return W.detach() * scale, b.detach(), threshold, float((worst_pos > worst_neg).double().mean())


def score(rows, asked, s: torch.Tensor, threshold: torch.Tensor) -> dict[str, float]:
    """Own-gate opening shares on the prompts asking a fact, no-gate-open shares on the rest."""
    opened = s > threshold
    out: dict[str, float] = {}
    for kind in ("request", "rephrase", "in_context"):
        idx = [k for k, (_, kd, _) in enumerate(rows) if kd == kind]
        out[f"{kind}/own_opens"] = float(opened[idx, [asked[k] for k in idx]].double().mean())
    after = [k for k, (_, kd, _) in enumerate(rows) if kd == "distracted" and asked[k] is not None]
    out["request_after_statement/own_opens"] = float(opened[after, [asked[k] for k in after]].double().mean())
    for kind in ("distracted", "same_subject", "neighbour"):
        idx = [k for k, (_, kd, _) in enumerate(rows) if kd == kind and asked[k] is None]
        out[f"{kind}/none_open"] = float((~opened[idx].any(1)).double().mean())
        out[f"{kind}/edit_own_opens"] = float(opened[idx, [rows[k][0] for k in idx]].double().mean())
    idx = [k for k, (_, kd, _) in enumerate(rows) if kd in ("request", "rephrase", "in_context")]
    others = opened[idx].clone()
    others[range(len(idx)), [asked[k] for k in idx]] = False
    out["asking/other_opens"] = float(others.any(1).double().mean())
    return out


def cached_readings(model, tok, texts, layers, cache: str | None, name: str):
    """:func:`.span_states.span_readings`, kept in ``cache`` (a folder) when given, so that a refit with
    other settings needs no forward pass; a cached file whose texts or layers differ is recomputed."""
    path = Path(cache) / f"{name}.pt" if cache else None
    if path is not None and path.is_file():
        saved = torch.load(path)
        fresh = saved["texts"] == list(texts) and saved["layers"] == list(layers)
        if fresh and all(set(d) >= set(READINGS) for d in saved["readings"].values()):
            return {layer: {r: t.double() for r, t in d.items()} for layer, d in saved["readings"].items()}
    readings = span_readings(model, tok, texts, layers)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        small = {layer: {r: t.float() for r, t in d.items()} for layer, d in readings.items()}
        torch.save({"texts": list(texts), "layers": list(layers), "readings": small}, path)
    return readings


def main(argv: list[str] | None = None) -> int:
    ap = slice_parser(__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layers", type=int, nargs="+", default=[8, 22])
    ap.add_argument("--steps", type=int, default=300, help="LBFGS iterations of the joint fit")
    ap.add_argument("--decay", type=float, default=1e-4, help="weight decay of the addresses")
    ap.add_argument("--cache", default=None, help="folder that keeps the readings between runs")
    args = ap.parse_args(argv)
    edits = load_edits(args.edits, skip_invalid=args.skip_invalid)[args.start : args.start + args.n]
    model, tok = load_model(args.model)
    corpus, _ = load_corpus(None, limit=4000, same_subject=8, seed=0)
    texts, pos_of = training_prompts(edits, corpus)
    rows = scope_prompts(edits)
    asked = asked_edit(rows, edits)
    tag = f"{Path(args.edits).stem}_{args.start}_{args.n}"
    train = cached_readings(model, tok, texts, args.layers, args.cache, f"train_{tag}")
    held = cached_readings(model, tok, [t for _, _, t in rows], args.layers, args.cache, f"held_{tag}")
    result: dict = {"edits": len(edits), "training_prompts": len(texts), "held_out_prompts": len(rows)}
    for layer in args.layers:
        for name in READINGS:
            W, b, threshold, separable = fit_addresses(train[layer][name], pos_of, len(edits), args.steps, args.decay)
            row = score(rows, asked, held[layer][name] @ W + b, threshold)
            row["separable_in_training"] = separable
            result[f"layer{layer}/{name}"] = row
            print(f"layer {layer:2d} {name:15s}", json.dumps(row), flush=True)
    save_result(result, "experiments.span_address_fit", argv, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
