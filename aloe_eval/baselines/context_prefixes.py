"""Context prefixes of the weight editors: short texts the model itself writes, put before an edit's
request so that its key and its target value hold after other text too (ROME's and MEMIT's
"context templates").

As the reference: each prefix starts from one of five words, continues by top-5 sampling to a fixed
number of tokens, and ends with ". ". The plain prompt (the empty prefix) always comes first. MEMIT
uses five prefixes of 10 tokens; ROME ten of 5 and ten of 10. The sampling is seeded, and the texts are
cached per model weights, so that every run (and the caches keyed by the prefixes) sees the same ones.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from aloe_build.checkpoints import write_atomically
from aloe_build.forward import model_device
from aloe_build.tokens import encode_prompt
from aloe_kernels import weight_fingerprint

from ..content_key import content_key

#: the words the reference starts its prefixes from
STARTS = ("The", "Therefore", "Because", "I", "You")
#: (tokens, count) of MEMIT's prefixes and of ROME's
MEMIT_LENGTHS = ((10, 5),)
ROME_LENGTHS = ((5, 10), (10, 10))


@torch.no_grad()
def sample_prefixes(model: nn.Module, tokenizer, tokens: int, count: int, seed: int = 0) -> list[str]:
    """``count`` prefixes of ``tokens`` tokens (start word included), ``count // 5`` from each start
    word, each sampled from the model's five likeliest next tokens and closed with ". "."""
    gen = torch.Generator().manual_seed(seed)
    device = model_device(model)
    out = []
    for word in STARTS:
        for _ in range(max(1, count // len(STARTS))):
            ids = encode_prompt(tokenizer, word)
            while len(ids) < tokens:
                logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
                top = torch.topk(torch.softmax(logits, -1), 5)
                ids.append(int(top.indices[torch.multinomial(top.values / top.values.sum(), 1, generator=gen)]))
            text = tokenizer.decode(ids, skip_special_tokens=True)
            out.append(" ".join(text.replace("{", " ").replace("}", " ").split()) + ". ")
    return out


def prefix_groups(
    model: nn.Module, tokenizer, lengths: Sequence[tuple[int, int]], cache_dir: str | Path | None = None
) -> list[list[str]]:
    """The prefix groups of an editor: ``[[""], <prefixes of the first length>, ...]``. Keys are
    averaged within each group, then across groups, as the reference does; target values are fitted
    on every prefix of every group. Read from ``cache_dir`` when the same weights made them."""
    fingerprint = weight_fingerprint(next(model.parameters()))
    key = content_key([fingerprint, [list(x) for x in lengths]])
    file = Path(cache_dir) / f"prefixes-{key}.json" if cache_dir is not None else None
    if file is not None and file.is_file():
        return json.loads(file.read_text())
    groups = [[""]] + [sample_prefixes(model, tokenizer, tokens, count) for tokens, count in lengths]
    if file is not None:
        file.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(file, lambda tmp: tmp.write_text(json.dumps(groups, ensure_ascii=False)))
    return groups


def flat(groups: Sequence[Sequence[str]]) -> list[str]:
    """Every prefix of every group, the plain prompt's first."""
    return [p for g in groups for p in g]
