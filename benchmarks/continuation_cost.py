"""Stage 3's request continuations and their states, the earlier way and the current one, timed in one process.

The earlier way generated each request's greedy continuation, then ran the continued sequences
through the model again for their states. The build now keeps the states the generation passes
through (``aloe_build.forward.generate_with_states``). For the first ``--requests`` requests of a
stream this prints, per way and batch size, the seconds taken, whether the tokens are the first
way's, and how far the unit states lie from the first way's.

    python -m benchmarks.continuation_cost --edits $DATA/counterfact/counterfact-val.json --requests 384
"""

from __future__ import annotations

import argparse
import time

import torch

from aloe_build.config import BuildConfig
from aloe_build.data import load_edits
from aloe_build.forward import generate_with_states, greedy_generate
from aloe_build.models import default_layer, load_model
from aloe_build.slots import make_slots
from aloe_build.token_tree import collect_states_tree
from aloe_build.tokens import encode_continuation, pad_id


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edits", required=True)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--layer", type=int, default=None, help="default: the model's default edit layer")
    ap.add_argument("--requests", type=int, default=384)
    ap.add_argument("--tokens", type=int, default=BuildConfig.negative_continuation_tokens)
    ap.add_argument("--ways", default="generate-then-pass:32,while-generating:32,while-generating:128",
                    help="comma-separated WAY:BATCH, WAY one of generate-then-pass, while-generating "
                         "(the first is the reference)")
    args = ap.parse_args(argv)
    model, tok = load_model(args.model)
    layer = default_layer(model) if args.layer is None else args.layer
    slots = make_slots(load_edits(args.edits, limit=args.requests))
    prompts = [list(encode_continuation(tok, s.prompt, s.target)[0]) for s in slots]
    print(f"{len(prompts)} requests, {args.tokens} tokens each, layer {layer}, {torch.get_num_threads()} threads")
    reference = None
    for spec in args.ways.split(","):
        way, _, batch = spec.partition(":")
        batch_size = int(batch or BuildConfig.batch_size)
        t0 = time.perf_counter()
        if way == "generate-then-pass":
            gens = greedy_generate(model, prompts, args.tokens, pad_id=pad_id(tok), batch_size=batch_size)
            seqs = [p + g for p, g in zip(prompts, gens)]
            states = collect_states_tree(model, tok, seqs, layer, [range(len(p), len(s)) for p, s in zip(prompts, seqs)]
                                         ).states
        elif way == "while-generating":
            gens, blocks = generate_with_states(model, prompts, args.tokens, layer, pad_id=pad_id(tok),
                                                batch_size=batch_size)
            states = torch.cat(blocks)
        else:
            ap.error(f"unknown way {way!r}")
        seconds = time.perf_counter() - t0
        if reference is None:
            reference = (seconds, gens, states)
            print(f"{spec}: {seconds:.1f} s")
            continue
        same = sum(g == r for g, r in zip(gens, reference[1]))
        line = f"{spec}: {seconds:.1f} s ({seconds / reference[0]:.2f} of the first); tokens equal for {same}/{len(gens)}"
        if same == len(gens):
            gap = (states - reference[2]).norm(dim=-1)
            line += (f"; distance of the unit states: mean {float(gap.mean()):.2e}, max {float(gap.max()):.2e}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
