"""Where do answers change after an edit's statement: at gates inside the statement or after it?

Each edit's first locality question is asked after its statement ("<request> <target>. <question>")
and answered greedily (10 tokens) by the unedited model and by the model with the operator's
residual added only at some positions: all of them, those inside the statement, those after it.
An answer that changes with the statement's positions alone was changed by the write added where
the edit's own request is read, carried to the question by attention.

    python experiments/distracted_leak_source.py OPERATOR_DIR EDITS [--skip-invalid] [--limit N]
"""

from __future__ import annotations

import argparse
import json
from typing import Callable

import torch

from aloe_build import load_edits, load_model
from aloe_build.data import fact_statement
from aloe_build.tokens import encode_prompt
from aloe_kernels import AloeOperator
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.reference import aloe_reference

ANSWER_TOKENS = 10


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("operator")
    ap.add_argument("edits")
    ap.add_argument("--skip-invalid", action="store_true")
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    model, tok = load_model("smollm2")
    op = AloeOperator.load(args.operator)
    mask: list[Callable[[int], torch.Tensor] | None] = [None]

    def add_residual(module, inputs, output):
        if mask[0] is None:
            return output
        h = inputs[0]
        keep = mask[0](h.shape[1]).to(output.dtype).view(1, -1, 1)
        return output + aloe_reference(h, op) * keep

    locate_down_proj(model, op.layer).module.register_forward_hook(add_residual)

    def greedy(ids: list[int]) -> list[int]:
        ids = list(ids)
        for _ in range(ANSWER_TOKENS):
            with torch.no_grad():
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[-ANSWER_TOKENS:]

    counts = {"prompts": 0, "changed_all": 0, "changed_statement_only": 0, "changed_after_only": 0}
    for e in load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid):
        if not e.locality:
            continue
        said = fact_statement(e.prompt, e.target_new)
        head = len(encode_prompt(tok, said))
        ids = encode_prompt(tok, f"{said} {e.locality[0].prompt}")
        mask[0] = None
        base = greedy(ids)
        counts["prompts"] += 1
        for name, fn in {
            "changed_all": lambda T: torch.ones(T),
            "changed_statement_only": lambda T: (torch.arange(T) < head).float(),
            "changed_after_only": lambda T: (torch.arange(T) >= head).float(),
        }.items():
            mask[0] = fn
            counts[name] += int(greedy(ids) != base)
    print(json.dumps(counts))


if __name__ == "__main__":
    main()
