"""Which slots open on the chat template itself: every position of one question asked through the
model's chat template (after its default system prompt and after each ``--system``), with the slot
whose gate is largest there wherever any gate is open.

A slot that opens on the system prompt or the template's own tokens opens on every conversation
served with that system prompt, whatever is asked; the chat evaluation's ``locality_changes``
counts such changes as "another slot, in prompt".

    python -m benchmarks.chat_template_gates --operator runs/ke-chat --system "You are a helpful assistant."
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


def main(argv: list[str] | None = None) -> None:
    from aloe_build import load_model

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--operator", required=True)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--question", default=QUESTION)
    p.add_argument("--system", action="append", default=[], help="a system prompt to ask after (repeatable)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, tok = load_model(args.model)
    op = AloeOperator.load(args.operator)
    for system in [None, *args.system]:
        print(f"system prompt: {'(template default)' if system is None else repr(system)}")
        for pos, text, slot, gate in open_positions(model, tok, op, args.question, system):
            print(f"  position {pos} {text!r}: slot {slot} gate {gate:.3f} ({op.edits[slot].get('request', '')!r})")


if __name__ == "__main__":
    main()
