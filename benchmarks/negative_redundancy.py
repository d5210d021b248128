"""How much of stage 3's edit-negative work repeats itself: token prefixes shared within a slot,
with the shared pool's prompts, and across the whole stream.

The state at position t depends only on tokens 0..t, so two sequences with the same first t+1
tokens have the same state there. This counts, for a stream, the edit-negative positions whose
prefix the same slot already has (a duplicate negative of that slot), whose prefix is a prompt
prefix of the shared pool (already a negative of every slot), and the distinct prefixes over all
slots (what a forward pass sharing prefixes would compute). Tokenization only, no forward pass.
Stage 3 now keeps each prefix of a slot once and leaves out the pool's prompt prefixes, so
``repeated_within_slot`` and ``of_which_pool_prefixes`` read 0 and ``positions`` is what remains
(CounterFact val, first 1,301: 334,648 positions at first, 231,669 with each prefix of a slot once,
204,165 without the pool's prompt prefixes).

    python -m benchmarks.negative_redundancy --edits $DATA/counterfact/counterfact-val.json --limit 1301
"""

from __future__ import annotations

import argparse
import json
import random

from aloe_build.config import BuildConfig
from aloe_build.corpus import load_corpus
from aloe_build.data import load_edits
from aloe_build.models import load_model
from aloe_build.rollouts import edit_negative_sequences, pool_prompt_prefixes, token_sequences
from aloe_build.slots import make_slots


def redundancy(tokenizer, requests, cfg: BuildConfig) -> dict[str, float]:
    """Counts of edit-negative positions by what their token prefix repeats."""
    slots = make_slots(requests)
    corpus, _ = load_corpus(cfg.encoder_corpus, cfg.encoder_records, cfg.encoder_same_subject, cfg.seed)
    seqs = token_sequences(tokenizer, slots, corpus, cfg)
    spec, pos, owner = edit_negative_sequences(tokenizer, slots, seqs, corpus, cfg, random.Random(cfg.seed))
    pool = pool_prompt_prefixes(tokenizer, corpus, cfg)
    own: set[tuple[int, tuple[int, ...]]] = set()
    distinct: set[tuple[int, ...]] = set()
    total = repeated = 0
    for ids, keep, i in zip(spec, pos, owner):
        for t in keep:
            key = tuple(ids[: t + 1])
            total += 1
            repeated += (i, key) in own
            own.add((i, key))
            distinct.add(key)
    in_pool = sum(key in pool for _, key in own)
    return {"edits": len(slots), "positions": total, "repeated_within_slot": repeated,
            "unique_slot_prefixes": len(own), "of_which_pool_prefixes": in_pool, "distinct_prefixes": len(distinct)}


def main(argv: list[str] | None = None) -> dict[str, float]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edits", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="smollm2")
    args = ap.parse_args(argv)
    _, tokenizer = load_model(args.model)
    out = redundancy(tokenizer, load_edits(args.edits, limit=args.limit), BuildConfig())
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
