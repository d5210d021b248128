"""Raw inputs of an MLP down-projection, read where the weight editors (ROME, MEMIT, AlphaEdit)
read them: the key of an edit is the input at the last token of its subject, which stays the same
however the rest of the request is worded.

These are the unnormalized states the weight multiplies (ALOE's own addresses use unit states).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from aloe_build.states import collect_states
from aloe_build.tokens import encode_prompt


class SubjectNotFound(ValueError):
    """The subject does not occur in the prompt, or its tokens do not end at a token boundary."""


def subject_last_index(tokenizer, prompt: str, subject: str) -> int:
    """Index, in ``encode_prompt(tokenizer, prompt)``, of the last token of the subject's last
    occurrence in the prompt. The prompt's tokens up to there must be those of the text that ends
    with the subject (no merge across the subject's end)."""
    at = prompt.rfind(subject) if subject else -1
    if at < 0:
        raise SubjectNotFound(f"subject {subject!r} does not occur in {prompt!r}")
    whole = encode_prompt(tokenizer, prompt)
    head = encode_prompt(tokenizer, prompt[: at + len(subject)])
    if not head or whole[: len(head)] != head:
        raise SubjectNotFound(f"the tokens of {prompt!r} do not break after the subject {subject!r}")
    return len(head) - 1


def down_proj_inputs(
    model: nn.Module,
    tokenizer,
    sequences: Sequence[Sequence[int]],
    positions: Sequence[Sequence[int]],
    layer: int,
    batch_size: int = 16,
) -> list[torch.Tensor]:
    """For each token sequence, the raw down-projection inputs of ``layer`` at its ``positions``
    (0-based in the unpadded sequence), float32 on the CPU: one (len(positions[i]), d) tensor each."""
    got = collect_states(model, tokenizer, sequences, layer, positions, batch_size, normalize=False)
    return [got.of(i) for i in range(len(sequences))]


def subject_keys(
    model: nn.Module, tokenizer, prompts: Sequence[str], subjects: Sequence[str], layer: int, batch_size: int = 16
) -> torch.Tensor:
    """The key of each edit, (n, d): the raw down-projection input of ``layer`` at the last token of
    its subject in its prompt, from the model as it is."""
    seqs = [encode_prompt(tokenizer, p) for p in prompts]
    at = [[subject_last_index(tokenizer, p, s)] for p, s in zip(prompts, subjects)]
    rows = down_proj_inputs(model, tokenizer, seqs, at, layer, batch_size)
    return torch.cat(rows) if rows else torch.zeros(0, 0)
