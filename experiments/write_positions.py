"""Paired: one operator served with ``write_positions="all"`` and ``"generated"`` on the same prompts.

Per edit (greedy, KV cache, as served): the request (exact target tokens); the request after an
unrelated sentence; its first rephrase; up to two locality prompts asked alone and after the edit's
statement, plain and as two user turns of the chat template (answers compared with the unedited
model's; leak: the edit's target appears where the unedited answer lacked it); the request through
the chat template after its default and a custom system prompt (target in the answer).

    python -m experiments.write_positions OPERATOR_DIR EDITS [--limit N] [--skip-invalid] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from aloe_build import load_edits, load_model
from aloe_build.forward import greedy_generate
from aloe_build.tokens import chat_prompt, encode_continuation, encode_prompt, pad_id, stop_ids, until_end
from aloe_eval.chat import CHAT_TOKENS, CUSTOM_SYSTEM
from aloe_eval.metrics import contains_target
from aloe_eval.plan import distracted_prompt, statement
from aloe_kernels import AloeOperator, apply_aloe, remove_aloe
from aloe_kernels.write_positions import WRITE_POSITIONS

UNRELATED = "The weather stayed mild all week, and the market opened late on Monday."
ANSWER_TOKENS = 10


def jobs_of(tok, edits) -> list[tuple[str, list[int], int, object]]:
    """(kind, prompt ids, tokens to generate, target ids or target text) for every edit."""
    jobs = []
    for e in edits:
        pid, tid = map(list, encode_continuation(tok, e.prompt, e.target_new))
        jobs.append(("efficacy", pid, len(tid), tid))
        uid, ut = map(list, encode_continuation(tok, f"{UNRELATED} {e.prompt}", e.target_new))
        jobs.append(("after_unrelated", uid, len(ut), ut))
        for r in e.rephrases[:1]:
            rid, rt = map(list, encode_continuation(tok, r, e.target_new))
            jobs.append(("rephrase", rid, len(rt), rt))
        for lp in e.locality[:2]:
            jobs.append(("locality", encode_prompt(tok, lp.prompt), ANSWER_TOKENS, None))
            jobs.append(("distracted", encode_prompt(tok, distracted_prompt(e, lp.prompt)), ANSWER_TOKENS, e.target_new))
            jobs.append(("chat_distracted", chat_prompt(tok, [statement(e), lp.prompt]), CHAT_TOKENS, e.target_new))
        jobs.append(("chat_default_system", chat_prompt(tok, e.prompt), CHAT_TOKENS, e.target_new))
        jobs.append(("chat_custom_system", chat_prompt(tok, e.prompt, CUSTOM_SYSTEM), CHAT_TOKENS, e.target_new))
    return jobs


def score(tok, jobs, gens, base) -> dict[str, float]:
    """Rates per kind (module doc)."""
    stops, hits = stop_ids(tok), {}
    for (kind, _, _, tgt), g, b in zip(jobs, gens, base):
        if kind in ("efficacy", "after_unrelated", "rephrase"):
            hits.setdefault(kind, []).append(g == tgt)
            continue
        if kind.startswith("chat"):
            g, b = until_end(g, stops), until_end(b, stops)
        if kind.startswith("chat_") and "system" in kind:
            hits.setdefault(kind, []).append(contains_target(tok.decode(g), tgt))
            continue
        hits.setdefault(kind, []).append(g == b)
        if tgt is not None:
            leak = contains_target(tok.decode(g), tgt) and not contains_target(tok.decode(b), tgt)
            hits.setdefault(kind + "_leak", []).append(leak)
    return {k: round(sum(v) / len(v), 3) for k, v in hits.items()} | {"n_" + k: len(v) for k, v in hits.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("operator")
    ap.add_argument("edits")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--skip-invalid", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, tok = load_model("smollm2")
    op = AloeOperator.load(args.operator)
    jobs = jobs_of(tok, load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid))

    def run() -> list[list[int]]:
        return greedy_generate(model, [j[1] for j in jobs], [j[2] for j in jobs], pad_id=pad_id(tok), batch_size=16)

    base, result = run(), {"operator": args.operator, "edits": args.edits, "limit": args.limit}
    for policy in WRITE_POSITIONS:
        t = time.perf_counter()
        apply_aloe(model, op, write_positions=policy)
        result[policy] = score(tok, jobs, run(), base) | {"seconds": round(time.perf_counter() - t, 1)}
        remove_aloe(model)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
