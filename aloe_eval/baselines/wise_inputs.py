"""What one WISE edit trains on: the request after each context prefix, and one unrelated statement.

**Prefixes** (EasyEdit's ``get_context_templates`` with ``length_params=[[5, 5], [10, 5]]``): the model
continues each of "I", "You", "Because", "Yes", "Q: " greedily by 5 and by 10 new tokens (stopping at
EOS); each text, decoded, followed by a space, is a prefix. With the plain prompt first that makes 11
in-scope rows, the same for every edit. The texts are cached per model weights.

**Rows.** In-scope: ``prefix + prompt + " " + target`` (the target's tokens from
:func:`aloe_build.tokens.encode_continuation`); out-of-scope: one statement of unrelated text (the
reference's ``loc_prompt``, a question and its answer from another split). All rows are left-padded into
one batch; the out-of-scope row is the last.

**Target loss.** Per in-scope row, the summed cross-entropy of its target tokens divided by their count
plus one (the reference's loss mask also counts the position before the first target prediction, where
the label is masked), then the mean over rows.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from aloe_build.checkpoints import write_atomically
from aloe_build.forward import greedy_generate
from aloe_build.tokens import encode_continuation, encode_prompt, end_index, left_pad, pad_id, stop_ids
from aloe_kernels import weight_fingerprint

from ..content_key import content_key

__all__ = ["EditBatch", "context_prefixes", "edit_batch", "target_loss"]

#: the words the reference's prefixes start from, and (new tokens, count) of its two groups
STARTS = ("I", "You", "Because", "Yes", "Q: ")
LENGTHS = ((5, 5), (10, 5))
#: the reference divides a row's target loss by its target length plus this (see the module docstring)
EXTRA_DENOMINATOR = 1


@torch.no_grad()
def generate_prefixes(model: nn.Module, tokenizer) -> list[str]:
    """The reference's context prefixes, the plain prompt's ``""`` first (see the module docstring)."""
    stops = stop_ids(tokenizer)
    prompts = [encode_prompt(tokenizer, w) for w in STARTS]
    out = [""]
    for new_tokens, count in LENGTHS:
        for _ in range(max(1, count // len(STARTS))):
            gens = greedy_generate(model, prompts, new_tokens, pad_id=pad_id(tokenizer), batch_size=len(prompts))
            for p, g in zip(prompts, gens):
                out.append(tokenizer.decode(list(p) + g[: end_index(g, stops)], skip_special_tokens=True) + " ")
    return out


def context_prefixes(model: nn.Module, tokenizer, cache_dir: str | Path | None = None) -> list[str]:
    """:func:`generate_prefixes`, read from ``cache_dir`` when the same weights made them."""
    key = content_key([weight_fingerprint(next(model.parameters())), STARTS, LENGTHS])
    file = Path(cache_dir) / f"wise-prefixes-{key}.json" if cache_dir is not None else None
    if file is not None and file.is_file():
        return json.loads(file.read_text())
    prefixes = generate_prefixes(model, tokenizer)
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(file, lambda tmp: tmp.write_text(json.dumps(prefixes, ensure_ascii=False)))
    return prefixes


@dataclasses.dataclass
class EditBatch:
    """One edit's rows, left-padded; the out-of-scope row last.

    ``keep``: how many last positions' logits the loss reads; ``labels`` (in-scope rows, keep): the
    target token each of those positions predicts, -100 where none; ``lengths``: target tokens per row."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    lengths: torch.Tensor
    keep: int

    @property
    def n_in_scope(self) -> int:
        return int(self.labels.shape[0])

    def inputs(self) -> dict[str, torch.Tensor]:
        return {"input_ids": self.input_ids, "attention_mask": self.attention_mask, "position_ids": self.position_ids}


def edit_batch(tokenizer, prompt: str, target: str, unrelated: str, prefixes: Sequence[str], device) -> EditBatch:
    """The rows of one edit (see the module docstring)."""
    rows, targets = [], []
    for prefix in prefixes:
        p, t = encode_continuation(tokenizer, prefix + prompt, target)
        rows.append(list(p) + list(t))
        targets.append(list(t))
    rows.append(encode_prompt(tokenizer, unrelated))
    ids, mask, pos = left_pad(rows, pad_id(tokenizer), device)
    keep = max(len(t) for t in targets) + 1
    labels = torch.full((len(targets), keep), -100, dtype=torch.long)
    for r, t in enumerate(targets):
        # with left padding every row ends at the last column: its targets are predicted from the
        # len(t) positions before that
        labels[r, keep - 1 - len(t) : keep - 1] = torch.tensor(t)
    lengths = torch.tensor([len(t) for t in targets], dtype=torch.float32)
    return EditBatch(ids, mask, pos, labels.to(device), lengths.to(device), keep)


def target_loss(logits: torch.Tensor, batch: EditBatch) -> torch.Tensor:
    """The target loss of the in-scope rows from the last ``batch.keep`` positions' logits."""
    n = batch.n_in_scope
    logits = logits[:n, -batch.keep :].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.labels.reshape(-1), reduction="none")
    per_row = ce.view(n, -1).sum(1) / (batch.lengths + EXTRA_DENOMINATOR)
    return per_row.mean()
