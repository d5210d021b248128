"""Which of an operator's slots open at the last token of a prompt, and how far?

Tells an address miss from a write miss on a handful of prompts: a control whose answer changed (a slot
opened where none should) or a rewording or request in context that kept the old answer (its own slot
stayed shut). Forward passes only; the gates are read as served (the running reading where the operator
has one).

    python -m experiments.prompt_gates OPERATOR_DIR "The Statue of Liberty is located in the city of" \\
        "Please answer the following question. Amazon was founded by" [--top 3] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from aloe_build.forward import teacher_forced
from aloe_build.models import load_model
from aloe_build.tokens import encode_prompt, pad_id
from aloe_eval.editors import AloeEditor
from aloe_kernels import AloeOperator


def prompt_gates(op: AloeOperator, model, tok, prompts: list[str], top: int = 3) -> list[dict]:
    """Per prompt: the ``top`` largest gates of ``op`` at its last token (slot, value, the slot's request)
    and the largest gate over all its tokens, with ``op`` patched into ``model`` for the pass only."""
    editor = AloeEditor(op)
    editor.attach(model)
    try:
        # one placeholder continuation token: only the prompt's gates are read
        seqs = [(encode_prompt(tok, p), encode_prompt(tok, " x", special=False)) for p in prompts]
        with editor.reading(model):
            results = teacher_forced(model, seqs, pad_id=pad_id(tok), editor=editor)
    finally:
        editor.detach(model)
    rows = []
    for prompt, r in zip(prompts, results):
        opened = []
        if r.gate_val is not None and r.gate_val.numel():
            for j in r.gate_val.argsort(descending=True)[:top].tolist():
                slot = int(r.gate_idx[j])
                opened.append({"slot": slot, "gate": float(r.gate_val[j]), "request": op.edits[slot].get("request")})
        rows.append({"prompt": prompt, "last_token": opened, "max_over_prompt": float(r.prompt_max_gate or 0.0)})
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("operator", help="artifact directory")
    ap.add_argument("prompts", nargs="+", help="prompts, as the model sees them (no chat template)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--top", type=int, default=3, help="gates listed per prompt")
    ap.add_argument("--out", help="also write the rows as JSON here")
    a = ap.parse_args(argv)
    model, tok = load_model(a.model)
    rows = prompt_gates(AloeOperator.load(a.operator), model, tok, a.prompts, a.top)
    for row in rows:
        tops = ", ".join(f"slot {g['slot']} {g['gate']:.3f} ({g['request']!r})" for g in row["last_token"]) or "none"
        print(f"{row['prompt']!r}: {tops}")
    if a.out:
        Path(a.out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
