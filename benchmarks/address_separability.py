"""Can any gate threshold open the rewordings and keep the neighbourhood shut? Read off the addresses.

Each slot's score v_i . h is put on the scale of its own calibration: r = 0 at its worst negative,
r = 1 at its worst anchor (stage 5's two scores; the gate opens at r = 1 and is exactly 0 at
r <= 0). For every rewording of an edit, r at its own slot (last prompt token); for every locality
prompt, the largest r over all slots and all its positions. A threshold placed at r = t opens the
rewordings with r >= t and keeps the locality prompts with max r < t shut. The cut table lists both
shares for a few t, and the AUC is the chance that a rewording's own r beats a locality prompt's
max r: where it is low no calibration of these addresses gives both generalization and locality,
and the miss is the address's, not the write's.

    python -m benchmarks.address_separability --operator runs/cf839 --edits runs/cf-stream.jsonl \\
        --limit 839 --out benchmarks/results/separability_smollm2_counterfact-stream/n839.json

The operator directory must hold its build's checkpoints (``checkpoints/5_calibrate.safetensors``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

CUTS = (0.0, 0.25, 0.5, 0.75, 1.0)


def relative_scores(V: torch.Tensor, worst_positive: torch.Tensor, worst_negative: torch.Tensor,
                    states: torch.Tensor) -> torch.Tensor:
    """r (N, n) of unit ``states`` at every slot: 0 at the slot's worst negative, 1 at its worst anchor."""
    return _relative(states.to(V.dtype) @ V.T, worst_positive, worst_negative)


def _relative(scores: torch.Tensor, worst_positive: torch.Tensor, worst_negative: torch.Tensor) -> torch.Tensor:
    return (scores - worst_negative) / (worst_positive - worst_negative).clamp_min(1e-12)


def separability(V: torch.Tensor, worst_positive: torch.Tensor, worst_negative: torch.Tensor,
                 rephrase_states: torch.Tensor, rephrase_slot: torch.Tensor, locality_states: torch.Tensor,
                 locality_prompt: torch.Tensor, prompts: int, cuts: tuple[float, ...] = CUTS,
                 chunk: int = 4096) -> dict:
    """The rewordings' own r, the locality prompts' max r, their AUC and the cut table.

    ``rephrase_slot[k]``: the slot of rewording k; ``locality_prompt[j]``: the prompt (0..prompts-1)
    of locality state j."""
    own = (rephrase_states.to(V.dtype) * V[rephrase_slot]).sum(-1)
    r_own = _relative(own, worst_positive[rephrase_slot], worst_negative[rephrase_slot])
    r_loc = torch.full((prompts,), -torch.inf, dtype=V.dtype)
    where = torch.zeros(prompts, dtype=torch.long)
    for lo in range(0, locality_states.shape[0], chunk):
        best, slot = relative_scores(V, worst_positive, worst_negative, locality_states[lo: lo + chunk]).max(1)
        owner = locality_prompt[lo: lo + chunk]
        r_new = r_loc.scatter_reduce(0, owner, best, reduce="amax")
        # the slot of each prompt's maximum, kept where this piece raised it
        raised = best >= r_new[owner]
        where[owner[raised]] = slot[raised]
        r_loc = r_new
    ranked = torch.sort(r_loc).values
    below = torch.searchsorted(ranked, r_own, right=False).double()
    at_or_below = torch.searchsorted(ranked, r_own, right=True).double()
    auc = float(((below + at_or_below) / 2).mean() / max(prompts, 1)) if r_own.numel() else None
    return {
        "rephrases": int(r_own.numel()),
        "locality_prompts": prompts,
        "auc_rephrase_over_locality": auc,
        "cuts": [{"t": t, "rephrases_at_or_above": float((r_own >= t).double().mean()),
                  "locality_below": float((r_loc < t).double().mean())} for t in cuts],
        "rephrase_r_quantiles": _quantiles(r_own),
        "locality_max_r_quantiles": _quantiles(r_loc),
        "locality_max_slots_distinct": int(where[r_loc > -torch.inf].unique().numel()),
    }


def _quantiles(x: torch.Tensor) -> dict[str, float]:
    qs = (0.1, 0.25, 0.5, 0.75, 0.9)
    if x.numel() == 0:
        return {}
    return {f"q{int(q * 100)}": float(torch.quantile(x.double(), q)) for q in qs}


def main(argv: list[str] | None = None) -> None:
    from safetensors.torch import load_file

    from aloe_build.data import load_edits
    from aloe_build.models import load_model
    from aloe_build.states import collect_states
    from aloe_build.tokens import encode_prompt
    from aloe_kernels import AloeOperator

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--operator", required=True, help="an operator directory with its build's checkpoints")
    ap.add_argument("--edits", required=True, help="the edit file it was built from")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=None, help="write the result here as JSON")
    args = ap.parse_args(argv)
    op = AloeOperator.load(args.operator)
    cal = load_file(str(Path(args.operator) / "checkpoints" / "5_calibrate.safetensors"))
    edits = load_edits(args.edits, limit=args.limit)
    if len(edits) != op.n:
        raise SystemExit(f"{len(edits)} edits but {op.n} slots: this reading needs one slot per edit")
    model, tok = load_model(args.model)
    rephrases = [(i, p) for i, e in enumerate(edits) for p in e.rephrases]
    locality = [x.prompt for e in edits for x in e.locality]
    r_ids = [encode_prompt(tok, p) for _, p in rephrases]
    r_states = collect_states(model, tok, r_ids, op.layer, [[len(s) - 1] for s in r_ids], desc="rewordings").states
    l_batch = collect_states(model, tok, [encode_prompt(tok, p) for p in locality], op.layer, desc="locality prompts")
    result = separability(op.addresses.float(), cal["worst_positive"].float(), cal["worst_negative"].float(),
                          r_states, torch.tensor([i for i, _ in rephrases], dtype=torch.long), l_batch.states,
                          l_batch.owner(), len(locality))
    result = {"operator": args.operator, "edits": args.edits, "limit": args.limit, **result}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
