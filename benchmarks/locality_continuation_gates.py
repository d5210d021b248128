"""Where the changed locality answers of a plain-protocol evaluation changed: in the prompt or in
the model's own continuation.

The evaluation's rows record, per locality prompt, the largest gate over the prompt's positions
only. A slot that opens later, on a token the model wrote itself, changes the answer with no gate
recorded. This re-generates each changed prompt's continuation with and without the operator and
counts, with :func:`aloe_eval.chat.changed_locality_gates`, the largest gate on the prompt and the
unedited continuation up to the first changed token: by size, by slot (the prompt's own edit or
another) and by place (prompt or continuation). It also prints a few unedited continuations.

    python -m benchmarks.locality_continuation_gates --operator runs/zsre-op --eval runs/zsre-op/eval
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

import torch

from aloe_build.forward import greedy_generate
from aloe_build.models import load_model
from aloe_build.tokens import encode_prompt, pad_id
from aloe_eval.chat import changed_locality_gates
from aloe_eval.editors import AloeEditor
from aloe_kernels import AloeOperator


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--operator", required=True, help="ALOE artifact directory")
    p.add_argument("--eval", required=True, help="directory of its plain-protocol evaluation (eval_rows.jsonl.gz)")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tokens", type=int, default=16, help="continuation length (default 16)")
    p.add_argument("--show", type=int, default=5, help="unedited continuations to print")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with gzip.open(Path(args.eval) / "eval_rows.jsonl.gz", "rt") as f:
        rows = [json.loads(line)["row"] for line in f]
    changed = [(x["prompt"], r["slot"]) for r in rows for x in r["locality_prompts"] if x["stable"] < 1]
    model, tokenizer = load_model(args.model)
    editor = AloeEditor(AloeOperator.load(args.operator))
    prompts = [encode_prompt(tokenizer, q) for q, _ in changed]  # as the evaluation encodes them
    unedited = greedy_generate(model, prompts, args.tokens, pad_id=pad_id(tokenizer))
    editor.attach(model)
    try:
        edited = greedy_generate(model, prompts, args.tokens, pad_id=pad_id(tokenizer))
    finally:
        editor.detach(model)
    differ = sum(a != b for a, b in zip(unedited, edited))
    print(f"changed locality prompts in the evaluation: {len(changed)}; "
          f"{differ} of them differ within {args.tokens} tokens here")
    counts = changed_locality_gates(model, tokenizer, editor, prompts, unedited, edited,
                                    [() if s is None else (s,) for _, s in changed])
    print("largest gate before the first changed token:", json.dumps(counts))
    for (q, _), a in list(zip(changed, unedited))[: args.show]:
        print(f"{q!r} -> {tokenizer.decode(a)!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
