"""Does an appended edit leak onto earlier edits when both facts are in the context?

For each appended edit (in ``APPENDED``, not in ``BASE``) and an earlier edit paired with it (the
base's edits in turn), the appended edit's statement is followed by the earlier edit's request:
"<appended request> <appended target>. <earlier request>". Greedy answers under the base operator
and under the appended one are compared on the same prompt, so copying from the context cancels
out:

- ``stable``: the answer is token for token the base operator's;
- ``leak``: it changed and now contains the appended edit's target, where the base's did not;
- ``earlier_kept``: the earlier edit's target still starts the answer (base: the same figure).

The reverse order ("<earlier statement>. <appended request>") gives ``appended_efficacy``: the
appended edit still fires after an earlier edit's fact. Plain prompts (10 tokens) and chat (the
statement and the request as two user turns, default system prompt, 32 tokens).

    python -m experiments.append_leak BASE_DIR APPENDED_DIR [--limit 100] --out FILE.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

from aloe_build import load_model
from aloe_build.forward import greedy_generate
from aloe_build.tokens import encode_prompt, pad_id
from aloe_eval.chat import CHAT_TOKENS, chat_answers
from aloe_eval.metrics import contains_target, starts_with_target
from aloe_eval.plan import statement
from aloe_kernels import AloeOperator, apply_aloe, remove_aloe
from aloe_kernels.write_positions import add_write_positions_argument

PLAIN_TOKENS = 10


def _requests(op: AloeOperator) -> list[SimpleNamespace]:
    return [SimpleNamespace(id=e["id"], prompt=e["request"], target_new=e["target"]) for e in op.edits]


def _answers(model, tok, op: AloeOperator, prompts: list, chat: bool, write_positions: str) -> list[str]:
    apply_aloe(model, op, write_positions=write_positions)
    try:
        if chat:
            ids = chat_answers(model, tok, prompts, None, tokens=CHAT_TOKENS)
        else:
            enc = [encode_prompt(tok, p) for p in prompts]
            ids = greedy_generate(model, enc, PLAIN_TOKENS, pad_id=pad_id(tok), batch_size=32)
    finally:
        remove_aloe(model)
    return [tok.decode(a, skip_special_tokens=True) for a in ids]


def measure(model, tok, base: AloeOperator, appended: AloeOperator, pairs: list, chat: bool, write_positions: str) -> dict:
    def ask(first, second):
        return [[statement(first), second.prompt]] if chat else [f"{statement(first)} {second.prompt}"]

    leak_prompts = [p for new, old in pairs for p in ask(new, old)]
    reverse_prompts = [p for new, old in pairs for p in ask(old, new)]
    before = _answers(model, tok, base, leak_prompts, chat, write_positions)
    after = _answers(model, tok, appended, leak_prompts, chat, write_positions)
    reverse = _answers(model, tok, appended, reverse_prompts, chat, write_positions)
    n = len(pairs)
    stable = sum(a == b for a, b in zip(before, after))
    leak = sum(
        a != b and contains_target(a, new.target_new) and not contains_target(b, new.target_new)
        for (new, _), a, b in zip(pairs, after, before)
    )
    return {
        "pairs": n,
        "stable": stable / n,
        "leak": leak / n,
        "earlier_kept": sum(starts_with_target(a, old.target_new) for (_, old), a in zip(pairs, after)) / n,
        "earlier_kept_base": sum(starts_with_target(b, old.target_new) for (_, old), b in zip(pairs, before)) / n,
        "appended_efficacy": sum(starts_with_target(a, new.target_new) for (new, _), a in zip(pairs, reverse)) / n,
        "examples": [{"prompt": p, "base": b, "appended": a} for p, a, b in list(zip(leak_prompts, after, before))[:5]],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("appended")
    ap.add_argument("--limit", type=int, default=100, help="appended edits tested (default 100)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", type=Path, required=True)
    add_write_positions_argument(ap)
    args = ap.parse_args()
    t0 = time.time()
    base, appended = AloeOperator.load(args.base), AloeOperator.load(args.appended)
    old_ids = set(base.ids)
    earlier = _requests(base)
    new = [r for r in _requests(appended) if r.id not in old_ids][: args.limit]
    if not new or not earlier:
        raise SystemExit("the appended operator holds no edit the base does not (or the base is empty)")
    stride = max(1, len(earlier) // len(new))
    pairs = [(r, earlier[(i * stride) % len(earlier)]) for i, r in enumerate(new)]
    model, tok = load_model(args.model)
    out = {"base": args.base, "appended": args.appended, "base_edits": base.n, "appended_edits": appended.n - base.n}
    out["write_positions"] = args.write_positions
    for chat in (False, True):
        out["chat" if chat else "plain"] = measure(model, tok, base, appended, pairs, chat, args.write_positions)
        print(json.dumps({k: v for k, v in out["chat" if chat else "plain"].items() if k != "examples"}), flush=True)
    out["seconds"] = round(time.time() - t0, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
