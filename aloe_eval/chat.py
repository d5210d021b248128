"""Requests asked as a served chat model is asked: through the model's own chat template.

Each edit's request becomes the user turn of a conversation (after the template's default system
prompt, or after :data:`CUSTOM_SYSTEM`); the model answers greedily for :data:`CHAT_TOKENS`
tokens. Metrics, per system prompt:

- ``efficacy``: the target appears in the answer (case-insensitive);
- ``efficacy_prefix``: the answer starts with the target (case-insensitive, leading space ignored);
- ``locality``: each locality prompt asked the same way gets token for token the unedited
  model's answer (up to its end of turn);
- ``unedited_efficacy``: how often the unedited model already gives the target (the floor).
"""

from __future__ import annotations

from typing import Any, Sequence

from aloe_build.forward import greedy_generate
from aloe_build.tokens import chat_prompt, pad_id

from .editors import Editor

CHAT_TOKENS = 32
CUSTOM_SYSTEM = "You are a helpful assistant. Answer the question directly."
SYSTEMS = {"default_system": None, "custom_system": CUSTOM_SYSTEM}


def _until_end(tokens: list[int], stops: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def contains_target(answer: str, target: str) -> bool:
    return target.strip().lower() in answer.lower()


def starts_with_target(answer: str, target: str) -> bool:
    return answer.strip().lower().startswith(target.strip().lower())


def _stop_ids(tokenizer) -> set[int]:
    stops = {tokenizer.eos_token_id}
    end_turn = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    return {t for t in (*stops, end_turn) if t is not None}


def chat_answers(model, tokenizer, questions: Sequence[str], system: str | None = None, *,
                 tokens: int = CHAT_TOKENS, batch_size: int = 32, progress: bool = False,
                 desc: str = "chat answers") -> list[list[int]]:
    """Greedy answers (token ids, cut after the end of turn) of ``questions`` asked as the user
    turn of the model's chat template, after ``system`` (None: the template's default)."""
    prompts = [chat_prompt(tokenizer, q, system) for q in questions]
    stops = _stop_ids(tokenizer)
    gens = greedy_generate(model, prompts, tokens, pad_id=pad_id(tokenizer), batch_size=batch_size,
                           progress=progress, desc=desc)
    return [_until_end(g, stops) for g in gens]


def chat_evaluation(model, tokenizer, requests: Sequence[Any], editor: Editor, *, batch_size: int = 32,
                    progress: bool = True, systems: dict[str, str | None] | None = None,
                    tokens: int = CHAT_TOKENS) -> dict[str, Any]:
    """Score ``editor`` on ``requests`` in chat form, once per system prompt (see the module doc)."""
    systems = SYSTEMS if systems is None else systems
    out: dict[str, Any] = {"tokens": tokens, "edits": len(requests)}
    for name, system in systems.items():
        asks = [r.prompt for r in requests]
        loc_owner = [i for i, r in enumerate(requests) for _ in r.locality]
        locs = [lp.prompt for r in requests for lp in r.locality]

        def answers(desc: str, questions=asks) -> list[list[int]]:
            return chat_answers(model, tokenizer, questions, system, tokens=tokens, batch_size=batch_size,
                                progress=progress, desc=f"chat ({name}): {desc}")

        base_ask, base_loc = answers("unedited requests"), answers("unedited locality", locs)
        editor.attach(model)
        try:
            ask, loc = answers("edited requests"), answers("edited locality", locs)
        finally:
            editor.detach(model)
        text = [tokenizer.decode(g, skip_special_tokens=True) for g in ask]
        base_text = [tokenizer.decode(g, skip_special_tokens=True) for g in base_ask]
        targets = [r.target_new for r in requests]
        stable_by_edit: dict[int, list[bool]] = {}
        for owner, a, b in zip(loc_owner, loc, base_loc):
            stable_by_edit.setdefault(owner, []).append(a == b)
        hit = [contains_target(t, y) for t, y in zip(text, targets)]
        out[name] = {
            "system": system,
            "efficacy": sum(hit) / len(hit),
            "efficacy_prefix": sum(starts_with_target(t, y) for t, y in zip(text, targets)) / len(text),
            "unedited_efficacy": sum(contains_target(t, y) for t, y in zip(base_text, targets)) / len(text),
            "locality": (sum(sum(v) / len(v) for v in stable_by_edit.values()) / len(stable_by_edit)
                         if stable_by_edit else None),
            "locality_prompts": len(locs),
            "misses": [{"request": r.prompt, "target": r.target_new, "answer": t}
                       for r, t, h in zip(requests, text, hit) if not h][:10],
        }
    return out


def chat_markdown(result: dict[str, Any]) -> str:
    """One row per system prompt."""
    lines = ["| system prompt | efficacy (target in answer) | exact prefix | unedited | chat locality |",
             "|---|---|---|---|---|"]
    for name in SYSTEMS:
        if name in result:
            r = result[name]
            loc = "n/a" if r["locality"] is None else f"{r['locality']:.4f}"
            lines.append(f"| {name} | {r['efficacy']:.4f} | {r['efficacy_prefix']:.4f} | "
                         f"{r['unedited_efficacy']:.4f} | {loc} |")
    return "\n".join(lines)
