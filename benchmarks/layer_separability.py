"""Do the raw states of any layer put rewordings nearer their request than locality prompts?

    python -m benchmarks.layer_separability --edits runs/cf-stream.jsonl --limit 839 \\
        --out benchmarks/results/separability_smollm2_counterfact-stream/layers_n839.json

For every ``--step``-th layer, the unit state at the last token of each request, rewording and
locality prompt (the down-projection input, as an address reads it), with each request's state as
its slot's address: the share of (rewording, locality prompt) pairs of one record in which the
rewording scores higher at the record's request; the AUC of a rewording's score at its own request
against a locality prompt's best score at any request; and the share of rewordings whose own request
is their nearest (top-1). A layer where these are high would be one where addresses start nearer
the rewordings; low everywhere, the layer is no lever for generalization.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.address_separability import auc, share_above_own


def readings(requests: torch.Tensor, rewordings: torch.Tensor, rewording_slot: torch.Tensor,
             locality: torch.Tensor, locality_slot: torch.Tensor) -> dict[str, float]:
    """The three readings of unit states, requests (n, d) as the addresses."""
    q, r, lo = (x.double() for x in (requests, rewordings, locality))
    own = (r * q[rewording_slot]).sum(1)
    at_request = (lo * q[locality_slot]).sum(1)
    best = (lo @ q.T).max(1).values
    return {"rewording_over_own_locality_prompt": share_above_own(own, rewording_slot, at_request, locality_slot),
            "auc_rewording_over_locality_best": auc(own, best),
            "rewording_top1": float(((r @ q.T).argmax(1) == rewording_slot).double().mean())}


def main(argv: list[str] | None = None) -> None:
    from aloe_build.data import load_edits
    from aloe_build.models import load_model
    from aloe_build.states import last_token_states

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--edits", required=True)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--step", type=int, default=2, help="every step-th layer, from the step-th")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    edits = load_edits(args.edits, limit=args.limit)
    model, tok = load_model(args.model)
    rewordings = [(i, p) for i, e in enumerate(edits) for p in e.rephrases]
    locality = [(i, x.prompt) for i, e in enumerate(edits) for x in e.locality]
    r_slot = torch.tensor([i for i, _ in rewordings], dtype=torch.long)
    l_slot = torch.tensor([i for i, _ in locality], dtype=torch.long)
    out = {"edits": args.edits, "limit": args.limit, "layers": {}}
    for layer in range(args.step, model.config.num_hidden_layers, args.step):
        states = [last_token_states(model, tok, texts, layer) for texts in
                  ([e.prompt for e in edits], [p for _, p in rewordings], [p for _, p in locality])]
        out["layers"][layer] = readings(states[0], states[1], r_slot, states[2], l_slot)
        print(layer, json.dumps(out["layers"][layer]), flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
