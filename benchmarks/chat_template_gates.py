"""Which slots open on the chat template itself: every position of one question asked through the
model's chat template (after its default system prompt and after each ``--system``), with the slot
whose gate is largest there wherever any gate is open.

A slot that opens on the system prompt or the template's own tokens opens on every conversation
served with that system prompt, whatever is asked; the chat evaluation's ``locality_changes``
counts such changes as "another slot, in prompt".

    python -m benchmarks.chat_template_gates --operator runs/ke-chat --system "You are a helpful assistant."

With ``--edits FILE`` it also asks every locality prompt of that stream through the template and
counts, per system prompt, those where some gate opens before any answer is written: a quick
reading of the chat evaluation's "in prompt" changes, with forwards only (no generation).
"""

from __future__ import annotations

import argparse

import torch

from aloe_build.states import collect_states
from aloe_build.tokens import chat_prompt
from aloe_build.writes import gates_of
from aloe_kernels import AloeOperator

QUESTION = "The place of birth of Ingrida Amantova is"


def open_positions(model, tokenizer, op: AloeOperator, question: str, system: str | None
                   ) -> list[tuple[int, str, int, float]]:
    """(position, token, slot, gate) of each position of the chat prompt where some gate is open,
    with the slot of the largest gate there."""
    ids = chat_prompt(tokenizer, question, system)
    gate, slot = gates_of(collect_states(model, tokenizer, [ids], op.layer).states, op).max(1)
    return [(p, tokenizer.decode(ids[p: p + 1]), int(slot[p]), float(gate[p]))
            for p in range(len(ids)) if gate[p] > 0]


def prompt_gates(model, tokenizer, op: AloeOperator, questions: list[str], owners: list[int], system: str | None,
                 open_threshold: float = 0.5, batch_size: int = 32) -> dict[str, int]:
    """Over the chat form of each question, the largest gate at any position: how many prompts have it
    open (at least ``open_threshold``), small or none, and whether its slot is ``owners[k]`` (the slot
    of the edit the question belongs to; -1 for none) or another."""
    counts = {"prompts": len(questions), "open": 0, "small": 0, "closed": 0, "own_slot": 0, "other_slot": 0}
    for lo in range(0, len(questions), batch_size):
        seqs = [chat_prompt(tokenizer, q, system) for q in questions[lo: lo + batch_size]]
        batch = collect_states(model, tokenizer, seqs, op.layer)
        for k in range(len(seqs)):
            g = gates_of(batch.of(k), op)
            best = float(g.max())
            if best <= 0:
                counts["closed"] += 1
                continue
            counts["open" if best >= open_threshold else "small"] += 1
            slot = int(g.max(0).values.argmax())
            counts["own_slot" if slot == owners[lo + k] else "other_slot"] += 1
    return counts


def main(argv: list[str] | None = None) -> None:
    from aloe_build import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--operator", required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--system", action="append", default=[], help="a system prompt to ask after (repeatable)")
    p.add_argument("--edits", help="a stream whose locality prompts are asked too (counts per system prompt)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    op = AloeOperator.load(args.operator)
    for system in [None, *args.system]:
        print(f"system prompt: {'(template default)' if system is None else repr(system)}")
        for pos, text, slot, gate in open_positions(model, tok, op, args.question, system):
            print(f"  position {pos} {text!r}: slot {slot} gate {gate:.3f} ({op.edits[slot].get('request', '')!r})")
        if args.edits:
            from aloe_build.data import load_edits

            slot_of = {e.get("request"): j for j, e in enumerate(op.edits)}
            requests = load_edits(args.edits, skip_invalid=True)
            questions = [lp.prompt for r in requests for lp in r.locality]
            owners = [slot_of.get(r.prompt, -1) for r in requests for _ in r.locality]
            print(f"  locality prompts of {args.edits}: {prompt_gates(model, tok, op, questions, owners, system)}")


if __name__ == "__main__":
    main()
