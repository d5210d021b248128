"""Which layer and token carry an edit's subject across its rewordings: for each rewording, is the
nearest edit request (by the cosine of the MLP down-projection inputs) its own?

ALOE's address reads the state at a prompt's last token at the edited layer; ROME, MEMIT and AlphaEdit
read it at the last token of the subject, at an early layer. This measures both, at several layers, on
the same edits: a rewording counts as found when its state is closer to its own request's state (same
layer, same kind of token) than to every other request's.

    python -m experiments.rewording_states --model smollm2 --edits FILE --limit 100 --out FILE.json
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
from aloe_eval.baselines.layer_inputs import SubjectNotFound, down_proj_inputs, subject_last_index
from aloe_eval.metrics import mean_with_se

#: the two reading points: the prompt's last token (ALOE) and the subject's last token (weight editors)
POSITIONS = ("last_token", "subject_last_token")


def _states(model: nn.Module, tokenizer, prompts: Sequence[str], subjects: Sequence[str], layer: int) -> dict[str, torch.Tensor]:
    """Unit down-projection inputs of ``layer`` at both reading points of each prompt."""
    seqs = [encode_prompt(tokenizer, p) for p in prompts]
    at = [[len(s) - 1, subject_last_index(tokenizer, p, subj)] for s, p, subj in zip(seqs, prompts, subjects)]
    rows = torch.stack(down_proj_inputs(model, tokenizer, seqs, at, layer)).double()  # (n, 2, d)
    rows = torch.nn.functional.normalize(rows, dim=-1)
    return {name: rows[:, k] for k, name in enumerate(POSITIONS)}


def rewording_retrieval(model: nn.Module, tokenizer, requests: Sequence[Any], layers: Sequence[int]) -> dict[str, Any]:
    """For each layer and reading point: the share of rewordings whose nearest request is their own
    (mean and standard error over rewordings), and the chance level 1 / edits."""
    edits, rewordings, owner, skipped = [], [], [], 0
    for r in requests:
        try:
            subject_last_index(tokenizer, r.prompt, r.subject)
        except SubjectNotFound:
            skipped += 1
            continue
        own = []
        for text in r.rephrases:
            try:
                subject_last_index(tokenizer, text, r.subject)
                own.append(text)
            except SubjectNotFound:
                skipped += 1
        if own:
            rewordings += own
            owner += [len(edits)] * len(own)
            edits.append(r)
    out: dict[str, Any] = {"edits": len(edits), "rewordings": len(rewordings), "skipped_prompts": skipped}
    out["chance"] = 1 / max(1, len(edits))
    owner_t = torch.tensor(owner)
    for layer in layers:
        req = _states(model, tokenizer, [r.prompt for r in edits], [r.subject for r in edits], layer)
        reph = _states(model, tokenizer, rewordings, [edits[o].subject for o in owner], layer)
        for pos in POSITIONS:
            found = (reph[pos] @ req[pos].T).argmax(1) == owner_t
            out[f"layer{layer}/{pos}"] = mean_with_se([float(x) for x in found])
    return out


def main(argv: list[str] | None = None) -> int:
    from aloe_build import load_edits, load_model

    ap = argparse.ArgumentParser(prog="python -m experiments.rewording_states", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--edits", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8, 14, 22])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    model, tok = load_model(args.model)
    result = rewording_retrieval(model, tok, load_edits(args.edits, limit=args.limit), args.layers)
    result["command"] = " ".join(["python -m experiments.rewording_states", *(argv or sys.argv[1:])])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
