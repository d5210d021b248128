"""Stage 3's edit-negative states with and without shared prefixes, timed in one process.

Takes a stream's edit-negative sequences in the order stage 3 runs them (sorted, so that a chunk
holds sequences with a common beginning), the first ``--sequences`` of them (one chunk is
``aloe_build.chunked.CHUNK_SEQUENCES``), and collects their states once with a plain pass per
sequence and once with each shared prefix run once; prints both times, their ratio and the largest
difference between the two results.

    python -m benchmarks.shared_prefix_cost --edits $DATA/counterfact/counterfact-val.json --limit 839
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from aloe_build.config import BuildConfig
from aloe_build.corpus import load_corpus
from aloe_build.data import load_edits
from aloe_build.models import default_layer, load_model
from aloe_build.rollouts import edit_negative_sequences, token_sequences
from aloe_build.shared_prefix import collect_states_shared, prefix_groups
from aloe_build.slots import make_slots
from aloe_build.states import collect_states


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edits", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layer", type=int, default=None, help="default: the model's default edit layer")
    ap.add_argument("--sequences", type=int, default=4096)
    args = ap.parse_args(argv)
    cfg = BuildConfig()
    model, tok = load_model(args.model)
    layer = default_layer(model) if args.layer is None else args.layer
    slots = make_slots(load_edits(args.edits, limit=args.limit))
    corpus, _ = load_corpus(cfg.encoder_corpus, cfg.encoder_records, cfg.encoder_same_subject, cfg.seed)
    seqs = token_sequences(tok, slots, corpus, cfg)
    spec, pos, _ = edit_negative_sequences(tok, slots, seqs, corpus, cfg, random.Random(cfg.seed))
    order = sorted(range(len(spec)), key=lambda i: tuple(spec[i]))[: args.sequences]
    spec, pos = [spec[i] for i in order], [pos[i] for i in order]
    groups = prefix_groups(spec, max_members=4 * cfg.batch_size)
    tokens = sum(len(s) for s in spec)
    after_sharing = sum(g.shared + sum(len(spec[i]) - g.shared for i in g.members) for g in groups)
    print(f"{len(slots)} slots, {len(spec)} sequences, {tokens} token positions, {after_sharing} "
          f"({after_sharing / tokens:.2f}) once each shared prefix runs once; layer {layer}, "
          f"{torch.get_num_threads()} threads")
    timed = {}
    for name, fn in (("plain", collect_states), ("shared prefixes", collect_states_shared)):
        t0 = time.perf_counter()
        got = fn(model, tok, spec, layer, pos, cfg.batch_size)
        timed[name] = (time.perf_counter() - t0, got)
        print(f"{name}: {timed[name][0]:.1f} s")
    (t_plain, plain), (t_shared, shared) = timed["plain"], timed["shared prefixes"]
    print(f"shared / plain time: {t_shared / t_plain:.2f}; max |difference| of the unit states "
          f"{float((plain.states - shared.states).abs().max()):.2e}")


if __name__ == "__main__":
    main()
