"""The single-edit probe: is the ceiling on rewordings the model's or the address's?

Each edit is applied alone to the unedited model by a weight editor that keys on the subject (ROME
here), scored as ``aloe eval`` scores a stream (greedy exact match of the target on the request and
on its rewordings; locality against the unedited model), then undone. Beside it, an in-context
control asks the unedited model the first rewording after the new fact is stated ("<request>
<target>. <rewording>"): if the model cannot produce the target even then, the limit is the model's.

    python -m experiments.probe --model smollm2 --edits FILE --layer 4 --out DIR [--limit N]

Each edit's row is appended to ``DIR/rows.jsonl`` as it finishes, so a rerun resumes; the second
moment and every target value are cached under ``$ALOE_CACHE/weight-edits``. ``DIR/summary.json``
holds each rate with its standard error.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from aloe_build.forward import teacher_forced
from aloe_build.tokens import encode_continuation, pad_id
from aloe_eval.baselines.layer_inputs import SubjectNotFound, subject_last_index
from aloe_eval.baselines.rome import fit_rome
from aloe_eval.baselines.weight_editors import corpus_second_moments, weight_edit_cache
from aloe_eval.metrics import mean_with_se


def produces(model, tokenizer, prompt: str, target: str) -> bool:
    """Whether greedy decoding after ``prompt`` starts with ``target`` (every target token the
    argmax given the ones before it, as ``aloe eval`` scores efficacy)."""
    p, t = encode_continuation(tokenizer, prompt, target)
    return teacher_forced(model, [(p, t)], pad_id=pad_id(tokenizer), batch_size=1)[0].preds == tuple(t)


def _row(model, tok, edit, layer: int, C: torch.Tensor, cache: Path) -> dict:
    from aloe_eval import evaluate

    t0 = time.perf_counter()
    subject_last_index(tok, edit.prompt, edit.subject)  # raises SubjectNotFound: no key to edit
    editor = fit_rome(model, tok, [edit], layer, C, cache)
    paper = evaluate(model, tok, [edit], editor, progress=False).summary["paper"]
    context = None
    if edit.rephrases:
        context = produces(model, tok, f"{edit.prompt} {edit.target_new.strip()}. {edit.rephrases[0]}", edit.target_new)
    return {
        "id": edit.id,
        "efficacy": paper["efficacy"],
        "generalization": paper["generalization"],
        "locality": paper["locality"],
        "in_context_rewording": context,
        "seconds": time.perf_counter() - t0,
    }


def main(argv: list[str] | None = None) -> int:
    from aloe_build import load_edits, load_model

    ap = argparse.ArgumentParser(prog="python -m experiments.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--edits", required=True)
    ap.add_argument("--layer", type=int, required=True, help="the layer ROME edits")
    ap.add_argument("--out", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--skip-invalid", action="store_true")
    args = ap.parse_args(argv)
    model, tok = load_model(args.model)
    edits = load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid)
    cache = weight_edit_cache()
    C = corpus_second_moments(model, tok, [args.layer])[args.layer]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows_file = out / "rows.jsonl"
    done = {json.loads(line)["id"] for line in rows_file.read_text().splitlines()} if rows_file.is_file() else set()
    skipped = []
    for i, edit in enumerate(edits):
        if edit.id in done:
            continue
        try:
            row = _row(model, tok, edit, args.layer, C, cache)
        except SubjectNotFound as err:
            skipped.append({"id": edit.id, "why": str(err)})
            continue
        with rows_file.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(f"{i + 1}/{len(edits)} {edit.id}: {row}", file=sys.stderr)
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    summary = {k: mean_with_se([r[k] for r in rows]) for k in ("efficacy", "generalization", "locality", "in_context_rewording")}
    summary.update(
        editor="ROME (reimplementation)",
        layer=args.layer,
        edits=len(rows),
        skipped=skipped,
        seconds_per_edit=mean_with_se([r["seconds"] for r in rows]),
    )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
