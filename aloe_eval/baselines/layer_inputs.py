"""Raw inputs of an MLP down-projection, read where the weight editors (ROME, MEMIT, AlphaEdit)
read them: the key of an edit is the input at the last token of its subject, which stays the same
however the rest of the request is worded.

These are the unnormalized states the weight multiplies (ALOE's own addresses use unit states).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from aloe_build.forward import StopForward, model_device, run_until_stopped
from aloe_build.states import collect_states
from aloe_build.tokens import batch_inputs, encode_prompt, pad_id
from aloe_kernels.hf import decoder_layers


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


def locatable(tokenizer, requests: Sequence[Any], prefixes: Sequence[str]) -> tuple[list[Any], list[str]]:
    """The requests whose subject ends at a token boundary in the prompt after every prefix, and
    the ids of the others (a weight editor cannot find their key; they stay unedited)."""
    keep, skipped = [], []
    for r in requests:
        try:
            for p in prefixes:
                subject_last_index(tokenizer, p + r.prompt, r.subject)
            keep.append(r)
        except SubjectNotFound:
            skipped.append(str(getattr(r, "id", r.prompt)))
    return keep, skipped


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


def averaged_subject_keys(
    model: nn.Module,
    tokenizer,
    prompts: Sequence[str],
    subjects: Sequence[str],
    layer: int,
    groups: Sequence[Sequence[str]],
    batch_size: int = 16,
) -> torch.Tensor:
    """The key of each edit averaged over context prefixes, (n, d) float64: the mean over
    ``groups`` of the mean over the group's prefixes of the subject key of ``prefix + prompt``
    (ROME's and MEMIT's k*; one group averages every prefix alike)."""
    texts = [p + prompt for prompt in prompts for g in groups for p in g]
    subj = [s for s in subjects for g in groups for _ in g]
    keys = subject_keys(model, tokenizer, texts, subj, layer, batch_size).double()
    per_edit = sum(len(g) for g in groups)
    out = []
    for i in range(len(prompts)):
        rows, start = keys[i * per_edit : (i + 1) * per_edit], 0
        means = []
        for g in groups:
            means.append(rows[start : start + len(g)].mean(0))
            start += len(g)
        out.append(torch.stack(means).mean(0))
    return torch.stack(out) if out else torch.zeros(0, 0, dtype=torch.float64)


@torch.no_grad()
def residual_at_subjects(
    model: nn.Module, tokenizer, prompts: Sequence[str], subjects: Sequence[str], layer: int, batch_size: int = 16
) -> torch.Tensor:
    """The residual stream after decoder layer ``layer`` at the last token of each subject in its
    prompt, (n, d_model) float64 (where MEMIT reads the current value of its target z)."""
    seqs = [encode_prompt(tokenizer, p) for p in prompts]
    at = [subject_last_index(tokenizer, p, s) for p, s in zip(prompts, subjects)]
    block = decoder_layers(model)[1][layer]
    box: dict = {}

    def keep_and_stop(module, args, out) -> None:
        box["out"] = out[0] if isinstance(out, tuple) else out
        raise StopForward  # the layers after this one are not needed

    handle = block.register_forward_hook(keep_and_stop)
    rows = []
    try:
        for start in range(0, len(seqs), batch_size):
            chunk, idx = seqs[start : start + batch_size], at[start : start + batch_size]
            width = max(len(s) for s in chunk)
            run_until_stopped(model, **batch_inputs(chunk, pad_id(tokenizer), model_device(model)))
            cols = torch.tensor([width - len(s) + i for s, i in zip(chunk, idx)])
            rows.append(box["out"][torch.arange(len(chunk)), cols].double().cpu())
    finally:
        handle.remove()
    return torch.cat(rows) if rows else torch.zeros(0, 0, dtype=torch.float64)
