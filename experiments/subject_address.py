"""An ALOE operator addressed where the weight editors read: the experiment that moves ALOE's address
from the prompt's last token to the subject's last token.

:mod:`experiments.rewording_states` finds that at the subject's last token a rewording's state is
nearest its own request's at every layer, where at the prompt's last token it rarely is. This builds
the operator that follows: at ``layer``, each edit's address is the unit down-projection input at the
last token of its subject in its request, and its write is MEMIT's target value there
(:mod:`aloe_eval.baselines.target_values`, the delta of the residual after the layer, which is what
the down-projection adds to). The operator's gate runs at every token, so it opens wherever the
subject's state appears, and the write reaches the answer through attention, as a weight edit does.

Each gate is calibrated as ALOE's paper calibrates a slot, at the midpoint between its own request
(score 1) and its hardest negative: the largest score of any token of the bundled construction corpus
(never an evaluated stream), with the temperature that puts both 7 logits from the threshold, so that
the gate is 0.999 on the request and in the dead zone on every corpus token.

    python -m experiments.subject_address --model smollm2 --edits FILE --limit 100 --out DIR
    aloe eval --model smollm2 --operator DIR --edits FILE --limit 100 ...
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from aloe_build.tokens import encode_prompt
from aloe_eval.baselines.layer_inputs import down_proj_inputs, locatable, subject_keys
from aloe_eval.baselines.target_values import MEMIT_VALUE
from aloe_kernels import AloeOperator, weight_fingerprint
from aloe_kernels.hf import locate_down_proj

#: the logits between tau and the calibration points on either side
MARGIN_LOGITS = 7.0


def unit_subject_states(model: nn.Module, tokenizer, prompts: Sequence[str], subjects: Sequence[str], layer: int) -> torch.Tensor:
    """Unit down-projection inputs at each prompt's subject's last token, (n, d) float64."""
    return torch.nn.functional.normalize(subject_keys(model, tokenizer, prompts, subjects, layer).double(), dim=-1)


def hardest_negatives(model: nn.Module, tokenizer, addresses: torch.Tensor, texts: Sequence[str], layer: int) -> torch.Tensor:
    """For each unit address (n, d), the largest score of any token of ``texts`` at ``layer``, (n,)."""
    best = torch.full((addresses.shape[0],), -1.0, dtype=torch.float64)
    seqs = [encode_prompt(tokenizer, t) for t in texts]
    for start in range(0, len(seqs), 256):  # a few thousand token states at a time
        chunk = seqs[start : start + 256]
        rows = down_proj_inputs(model, tokenizer, chunk, [range(len(q)) for q in chunk], layer)
        H = torch.nn.functional.normalize(torch.cat(rows).double(), dim=-1)
        best = torch.maximum(best, (H @ addresses.T).max(0).values)
    return best


def subject_operator(
    model: nn.Module, tokenizer, requests: Sequence[Any], layer: int, deltas: torch.Tensor, negatives: Sequence[str]
) -> AloeOperator:
    """The operator of ``requests`` (whose subjects must be locatable) with ``deltas`` (n, d_out) as
    writes, each gate calibrated against every token of the texts ``negatives`` (module doc)."""
    from aloe_build.models import model_name

    site = locate_down_proj(model, layer)
    A = unit_subject_states(model, tokenizer, [r.prompt for r in requests], [r.subject for r in requests], layer)
    hardest = hardest_negatives(model, tokenizer, A, negatives, layer).clamp(max=1 - 1e-3)
    return AloeOperator(
        addresses=A.float(),
        thresholds=((1 + hardest) / 2).float(),  # the midpoint of the request (1) and the hardest negative
        temperatures=(2 * MARGIN_LOGITS / (1 - hardest)).float(),
        writes=deltas.float(),
        edits=[
            {
                "id": str(r.id) if r.id is not None else f"edit-{i}",
                "request": r.prompt,
                "target": r.target_new,
                "subject": r.subject,
            }
            for i, r in enumerate(requests)
        ],
        layer=layer,
        module_path=site.path,
        base_model=model_name(model),
        weight_fingerprint=weight_fingerprint(site.weight()),
    )


def main(argv: list[str] | None = None) -> int:
    from aloe_build import load_edits, load_model
    from aloe_build.corpus import default_corpus_path
    from aloe_eval.baselines.context_prefixes import MEMIT_LENGTHS, flat, prefix_groups
    from aloe_eval.baselines.memit import target_deltas
    from aloe_eval.baselines.weight_editors import SECOND_MOMENT_RECORDS, weight_edit_cache

    ap = argparse.ArgumentParser(prog="python -m experiments.subject_address", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--edits", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--skip-invalid", action="store_true")
    ap.add_argument("--layer", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    model, tok = load_model(args.model)
    edits, skipped = locatable(tok, load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid), [""])
    groups = prefix_groups(model, tok, MEMIT_LENGTHS, weight_edit_cache())
    deltas = target_deltas(model, tok, edits, args.layer, flat(groups), MEMIT_VALUE, weight_edit_cache(), progress=True)
    corpus = load_edits(default_corpus_path(), limit=SECOND_MOMENT_RECORDS)
    negatives = [f"{r.prompt} {r.ground_truth or ''}".strip() for r in corpus]
    op = subject_operator(model, tok, edits, args.layer, deltas, negatives)
    op.save(args.out)
    info = {"edits": len(edits), "skipped_subject_not_found": skipped, "layer": args.layer}
    info["thresholds"] = {
        "min": float(op.thresholds.min()),
        "median": float(op.thresholds.median()),
        "max": float(op.thresholds.max()),
    }
    info["command"] = " ".join(["python -m experiments.subject_address", *(argv or sys.argv[1:])])
    (Path(args.out) / "subject_address.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
