"""``aloe demo``: the main job end to end on the bundled default.

Loads SmolLM2-135M-Instruct, builds an operator for the bundled
counterfactual facts, then prints the model's answers before and after the
edit for the edited requests, the same requests after an unrelated sentence,
their paraphrases, the requests asked through the model's chat template (as a
served chat model is asked) and unrelated controls, plain and in chat, and
finally shows that removing the operator restores the original model.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence

import torch

from .options import MODEL_HELP, add_device_args

DEMO_EDITS = Path(__file__).resolve().parents[1] / "examples" / "demo_edits.jsonl"


def greedy(model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 6, batch_size: int = 16) -> list[str]:
    """Greedy continuations of raw-text prompts (left padding)."""
    out: list[str] = []
    for start in range(0, len(prompts), batch_size):
        enc = tokenizer(list(prompts[start : start + batch_size]), return_tensors="pt", padding=True).to(model.device)
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        out += [tokenizer.decode(row[enc["input_ids"].shape[1] :], skip_special_tokens=True) for row in ids]
    return out


def hits(text: str, target: str) -> bool:
    return text.strip().lower().startswith(target.strip().lower())


def chat_texts(model, tokenizer, questions: Sequence[str]) -> list[str]:
    """Answers to ``questions`` asked through the chat template (default system prompt), decoded."""
    from aloe_eval.chat import chat_answers

    return [tokenizer.decode(a, skip_special_tokens=True) for a in chat_answers(model, tokenizer, questions)]


def run_demo(
    edits_path: Path,
    out_dir: Path,
    model_name: str = "smollm2",
    limit: int | None = None,
    device: str | None = None,
    dtype: str | None = None,
    settings: dict | None = None,
) -> dict:
    """Edit ``model_name`` on ``edits_path`` into ``out_dir`` and print answers before/after; returns the hit
    rates. ``settings``: BuildConfig fields over the demo preset's (``--set``)."""
    from aloe_build import BuildConfig, build_operator, load_edits, load_model
    from aloe_eval.in_context import in_context
    from aloe_eval.metrics import contains_target
    from aloe_kernels import AloeOperator, apply_aloe, remove_aloe

    # the settings and their reasons: aloe_build/presets.py (a mistyped --set key: ConfigError)
    config = BuildConfig.preset("demo", **(settings or {}))

    requests = load_edits(edits_path, limit=limit)
    print(f"loading {model_name} ...")
    model, tokenizer = load_model(model_name, dtype=dtype, device=device)
    prompts = [r.prompt for r in requests]
    in_ctx = [in_context(r.prompt, 1, i)[0] for i, r in enumerate(requests)]
    rephrases = [r.rephrases[0] for r in requests if r.rephrases]
    controls = [r.locality[0].prompt for r in requests if r.locality]

    def answers() -> list[list[str]]:
        plain = [greedy(model, tokenizer, p) for p in (prompts, in_ctx, rephrases, controls)]
        return plain + [chat_texts(model, tokenizer, p) for p in (prompts, controls)]

    before = answers()
    print(f"building an operator for {len(requests)} edits into {out_dir} ...")
    op = build_operator(model, tokenizer, requests, config, out_dir=out_dir)
    op.save(out_dir)
    op = AloeOperator.load(out_dir)  # serve what was written, as a user would
    apply_aloe(model, op)
    after = answers()
    remove_aloe(model)
    restored = greedy(model, tokenizer, controls)

    with_reph = [r for r in requests if r.rephrases]
    rows = [("request", prompts, requests), ("in-context request", in_ctx, requests), ("paraphrase", rephrases, with_reph)]
    scores = {}
    for (kind, texts, reqs), b, a in zip(rows, before, after):
        print(f"\n== {kind}s ==")
        for t, r, x, y in zip(texts, reqs, b, a):
            print(f"{t!r}\n    before: {x.strip()!r}\n    after:  {y.strip()!r}   (target {r.target_new!r})")
        scores[kind] = sum(hits(y, r.target_new) for y, r in zip(a, reqs)) / max(1, len(reqs))
    print("\n== requests asked in chat (the model's chat template, its default system prompt) ==")
    for t, r, x, y in zip(prompts, requests, before[4], after[4]):
        print(f"{t!r}\n    before: {x.strip()!r}\n    after:  {y.strip()!r}   (target {r.target_new!r})")
    scores["chat"] = sum(contains_target(y, r.target_new) for y, r in zip(after[4], requests)) / max(1, len(requests))
    for kind, b, a in (("unrelated controls", before[3], after[3]), ("unrelated controls in chat", before[5], after[5])):
        print(f"\n== {kind} (should not change) ==")
        for t, x, y in zip(controls, b, a):
            print(f"{t!r}\n    before: {x.strip()!r}\n    after:  {y.strip()!r}{'' if x == y else '   <- changed'}")
    scores["control_unchanged"] = sum(x == y for x, y in zip(before[3], after[3])) / max(1, len(controls))
    scores["chat_control_unchanged"] = sum(x == y for x, y in zip(before[5], after[5])) / max(1, len(controls))
    scores["restored_after_remove"] = float(restored == before[3])
    print(
        f"\nedited requests that now give the target: {scores['request']:.0%}\n"
        f"the same after an unrelated sentence:      {scores['in-context request']:.0%}\n"
        f"paraphrases that give the target:          {scores['paraphrase']:.0%}\n"
        f"chat answers that contain the target:      {scores['chat']:.0%}\n"
        f"unrelated controls unchanged:              {scores['control_unchanged']:.0%}\n"
        f"unrelated controls unchanged in chat:      {scores['chat_control_unchanged']:.0%}\n"
        f"outputs restored by remove_aloe:           {'yes' if scores['restored_after_remove'] else 'no'}\n"
        f"operator: {out_dir} ({len(requests)} edits in {op.n} slots; inspect with `aloe inspect {out_dir}`)"
    )
    return scores


def add_demo_cli(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="edit SmolLM2 on the bundled facts and show before/after answers")
    p.add_argument("--edits", default=str(DEMO_EDITS), help="edit requests (default: the bundled demo set)")
    p.add_argument("--out", default="runs/demo", help="where the operator is written")
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one BuildConfig field of the demo preset")
    add_device_args(p)
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(a: argparse.Namespace) -> int:
    from aloe_build.config import parse_settings

    run_demo(Path(a.edits), Path(a.out), a.model, a.limit, a.device, a.dtype, parse_settings(a.set or []))
    return 0
