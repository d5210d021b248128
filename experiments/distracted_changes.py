"""Which slot changed each distracted answer, and where: read from an ``aloe eval`` run.

For every distracted prompt ("<request> <target>. <locality prompt>") whose answer the operator
changed in an ``aloe eval`` run, the prompt is answered again greedily by the model patched as it is
served (``write_positions="generated"``: the residual at the prompt's last token and at each
generated token), and the gates are read at exactly those positions. Each change is attributed to
the first written position with an open gate (>= 0.5), to the slot with the largest gate there,
and that slot to the edit whose statement came first ("own") or another edit of the stream
("other"); "none open" when no gate reaches 0.5 at any written position (small gates only). Each
change also says whether the same locality prompt, asked alone, changed in that run.

    python -m experiments.distracted_changes EVAL_DIR OPERATOR_DIR [--model smollm2] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

import torch

from aloe_build import load_model
from aloe_build.tokens import encode_prompt
from aloe_eval import EvalReport
from aloe_kernels import AloeOperator, apply_aloe
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.reference import aloe_gates

OPEN = 0.5


def written_states(model, tokenizer, layer: int, prompt: str, answer_tokens: int) -> torch.Tensor:
    """The edited layer's input at the positions served writes: the prompt's last token, then each
    generated token (greedy, ``answer_tokens`` of them)."""
    calls: list[torch.Tensor] = []
    hook = locate_down_proj(model, layer).module.register_forward_pre_hook(lambda m, a: calls.append(a[0][0, -1].detach()))
    try:
        with torch.no_grad():
            ids = torch.tensor([encode_prompt(tokenizer, prompt)])
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=answer_tokens, do_sample=False)
    finally:
        hook.remove()
    return torch.stack(calls)


def attribute(gates: torch.Tensor, own_slot: int) -> tuple[str, str, int, float]:
    """(own/other, where, slot, gate) of the first written position with an open gate, else of the largest gate."""
    top, slot = gates.max(dim=1)
    opened = (top >= OPEN).nonzero()
    at = int(opened[0]) if len(opened) else int(top.argmax())
    where = "none open" if not len(opened) else ("last prompt token" if at == 0 else "generated token")
    return ("own" if int(slot[at]) == own_slot else "other"), where, int(slot[at]), float(top[at])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("eval_dir", type=Path)
    ap.add_argument("operator")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    model, tokenizer = load_model(args.model)
    op = AloeOperator.load(args.operator)
    apply_aloe(model, op)  # the default write_positions, as served
    rows = EvalReport.load(args.eval_dir).editors["ALOE"].rows
    slot_request = {r["slot"]: f"{r['prompt']} -> {r['target']}" for r in rows}
    changed = [(r, d) for r in rows for d in r["distracted_prompts"] if d["stable"] < 1]
    counts: Counter = Counter()
    examples = []
    for row, d in changed:
        n = max(1, len(tokenizer(d["generation"], add_special_tokens=False)["input_ids"]))
        states = written_states(model, tokenizer, op.layer, d["prompt"], n)
        who, where, slot, gate = attribute(aloe_gates(states.float(), op), row["slot"])
        alone = next((lp["stable"] < 1 for lp in row["locality_prompts"] if d["prompt"].endswith(lp["prompt"])), None)
        counts[f"{who} | {where} | {'leak' if d['leak'] else 'changed'} | {'also' if alone else 'not'} changed alone"] += 1
        examples.append(
            {
                "prompt": d["prompt"],
                "reference": d["reference"],
                "answer": d["generation"],
                "leak": bool(d["leak"]),
                "who": who,
                "where": where,
                "changed_alone": alone,
                "gate": round(gate, 3),
                "slot_edit": slot_request.get(slot),
            }
        )
    summary = {"changed": len(changed), "by_cause": dict(sorted(counts.items())), "examples": examples}
    for k, v in summary["by_cause"].items():
        print(f"{v:4d}  {k}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
