"""Can any gate threshold open the rewordings and keep the neighbourhood shut? Read off the addresses.

Each slot's score v_i . h is put on the scale of its own calibration: r = 0 at its worst negative,
r = 1 at its worst anchor (stage 5's two scores; the gate opens at r = 1 and is exactly 0 at
r <= 0). For every rewording of an edit, r at its own slot (last prompt token); for every locality
prompt, the largest r over all slots and all its positions. A threshold placed at r = t opens the
rewordings with r >= t and keeps the locality prompts with max r < t shut. The cut table lists both
shares for a few t, and the AUC is the chance that a rewording's own r beats a locality prompt's
max r: where it is low no calibration of these addresses gives both generalization and locality,
and the miss is the address's, not the write's.

    python -m aloe_eval.separability --operator runs/cf839 --edits runs/cf-stream.jsonl \\
        --limit 839 --out benchmarks/results/separability_smollm2_counterfact-stream/n839.json

The operator directory must hold its build's checkpoints (``checkpoints/5_calibrate.safetensors``).

``--stages`` reads the addresses at three points of the build, without a calibration of their own:
the unit request state (a raw address), stage 2's initial addresses (the encoder's) and stage 4's
refined ones. For each: the share of rewordings that score above their own record's locality prompt
at their own slot; the AUC of a rewording's score at its slot against a locality prompt's best score
over all slots and positions (one threshold for every unit address); and, from the build's stage-3
states (``checkpoints/3_rollouts.safetensors``), the share of slots whose worst anchor clears the
worst negative of each kind (the corpus pool, other slots' anchors and continuations, the slot's
own edit negatives) and of all of them, which is what calibration needs.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from aloe_build.mechanism_protocol import auc
from aloe_build.slots import SamePrompt

CUTS = (0.0, 0.25, 0.5, 0.75, 1.0)


def share_above_own(scores: torch.Tensor, slots: torch.Tensor, other: torch.Tensor, other_slots: torch.Tensor) -> float | None:
    """Over every pair of one slot, the share in which ``scores`` is above ``other`` (None: no pair)."""
    above = (scores[:, None] > other[None, :])[slots[:, None] == other_slots[None, :]]
    return float(above.double().mean()) if above.numel() else None


def relative_scores(
    V: torch.Tensor, worst_positive: torch.Tensor, worst_negative: torch.Tensor, states: torch.Tensor
) -> torch.Tensor:
    """r (N, n) of unit ``states`` at every slot: 0 at the slot's worst negative, 1 at its worst anchor."""
    return _relative(states.to(V.dtype) @ V.T, worst_positive, worst_negative)


def _relative(scores: torch.Tensor, worst_positive: torch.Tensor, worst_negative: torch.Tensor) -> torch.Tensor:
    return (scores - worst_negative) / (worst_positive - worst_negative).clamp_min(1e-12)


def separability(
    V: torch.Tensor,
    worst_positive: torch.Tensor,
    worst_negative: torch.Tensor,
    rephrase_states: torch.Tensor,
    rephrase_slot: torch.Tensor,
    locality_states: torch.Tensor,
    locality_prompt: torch.Tensor,
    prompts: int,
    cuts: tuple[float, ...] = CUTS,
    chunk: int = 4096,
) -> dict:
    """The rewordings' own r, the locality prompts' max r, their AUC and the cut table.

    ``rephrase_slot[k]``: the slot of rewording k; ``locality_prompt[j]``: the prompt (0..prompts-1)
    of locality state j."""
    own = (rephrase_states.to(V.dtype) * V[rephrase_slot]).sum(-1)
    r_own = _relative(own, worst_positive[rephrase_slot], worst_negative[rephrase_slot])
    r_loc = torch.full((prompts,), -torch.inf, dtype=V.dtype)
    where = torch.zeros(prompts, dtype=torch.long)
    for lo in range(0, locality_states.shape[0], chunk):
        best, slot = relative_scores(V, worst_positive, worst_negative, locality_states[lo : lo + chunk]).max(1)
        owner = locality_prompt[lo : lo + chunk]
        r_new = r_loc.scatter_reduce(0, owner, best, reduce="amax")
        # the slot of each prompt's maximum, kept where this piece raised it
        raised = best >= r_new[owner]
        where[owner[raised]] = slot[raised]
        r_loc = r_new
    return {
        "rephrases": int(r_own.numel()),
        "locality_prompts": prompts,
        "auc_rephrase_over_locality": auc(r_own, r_loc) if r_own.numel() else None,
        "cuts": [
            {
                "t": t,
                "rephrases_at_or_above": float((r_own >= t).double().mean()),
                "locality_below": float((r_loc < t).double().mean()),
            }
            for t in cuts
        ],
        "rephrase_r_quantiles": _quantiles(r_own),
        "locality_max_r_quantiles": _quantiles(r_loc),
        "locality_max_slots_distinct": int(where[r_loc > -torch.inf].unique().numel()),
    }


def stage_readings(
    V: torch.Tensor,
    request_states: torch.Tensor,
    rephrase_states: torch.Tensor,
    rephrase_slot: torch.Tensor,
    locality_last: torch.Tensor,
    locality_slot: torch.Tensor,
    locality_states: torch.Tensor,
    locality_prompt: torch.Tensor,
    prompts: int,
) -> dict:
    """Threshold-free readings of addresses ``V`` (n, d) on unit states (see ``--stages``)."""
    U = torch.nn.functional.normalize(V.double(), dim=1)
    own = (rephrase_states.double() * U[rephrase_slot]).sum(1)
    at_slot = (locality_last.double() * U[locality_slot]).sum(1)
    best = torch.full((prompts,), -torch.inf, dtype=torch.double).scatter_reduce(
        0, locality_prompt, (locality_states.double() @ U.T).max(1).values, reduce="amax"
    )
    # every (rewording, locality prompt) pair of one record, both scored at its slot
    return {
        "rewording_over_own_locality_prompt": share_above_own(own, rephrase_slot, at_slot, locality_slot),
        "auc_rewording_over_locality_best": auc(own, best),
        "mean_unit_score": {
            "request": float((request_states.double() * U).sum(1).mean()),
            "rewording": float(own.mean()),
            "own_locality_prompt": float(at_slot.mean()),
        },
    }


def clears_negatives(V: torch.Tensor, roll: dict[str, torch.Tensor], same_prompt: SamePrompt) -> dict[str, float]:
    """Share of slots whose worst anchor scores above the worst negative of each kind, and of all."""
    from aloe_build.slot_sets import NegativeSet, min_anchor_scores, negative_set

    V = V.float()
    worst_anchor = min_anchor_scores(V, roll["anchors"].float(), roll["anchor_owner"])
    none = torch.empty(0, V.shape[1]), torch.empty(0, dtype=torch.long)
    kinds = {
        "pool": NegativeSet(roll["pool"], torch.full((roll["pool"].shape[0],), -1, dtype=torch.long), *none),
        "other slots' anchors": NegativeSet(roll["anchors"], roll["anchor_owner"], *none),
        "continuations": NegativeSet(roll["continuations"], roll["continuation_owner"], *none),
        "own edit negatives": NegativeSet(*none, roll["specific"], roll["specific_owner"]),
        "all": negative_set(roll),
    }
    out = {}
    for name, negatives in kinds.items():
        worst = negatives.worst(V, same_prompt)
        out[name] = float((worst_anchor > worst).double().mean())
    return out


def _quantiles(x: torch.Tensor) -> dict[str, float]:
    qs = (0.1, 0.25, 0.5, 0.75, 0.9)
    if x.numel() == 0:
        return {}
    return {f"q{int(q * 100)}": float(torch.quantile(x.double(), q)) for q in qs}


def _stages(run: str, model, tok, edits, layer: int, r_states, rephrases, locality, l_batch) -> dict:
    """The ``--stages`` readings of a build directory's checkpoints."""
    from safetensors.torch import load_file

    from aloe_build.states import last_token_states

    ck = Path(run) / "checkpoints"
    roll = load_file(str(ck / "3_rollouts.safetensors"))
    requests = last_token_states(model, tok, [e.prompt for e in edits], layer, desc="requests")
    addresses = {
        "raw request state": requests,
        "stage 2 (encoder)": load_file(str(ck / "2_init.safetensors"))["V0"],
        "stage 4 (refined)": load_file(str(ck / "4_refine.safetensors"))["V"],
    }
    loc_slot = torch.tensor([i for i, e in enumerate(edits) for _ in e.locality], dtype=torch.long)
    loc_last = last_token_states(model, tok, locality, layer, desc="locality prompts, last token")
    same_prompt = SamePrompt.of(edits)
    out = {}
    for name, V in addresses.items():
        out[name] = stage_readings(
            V,
            requests,
            r_states,
            torch.tensor([i for i, _ in rephrases], dtype=torch.long),
            loc_last,
            loc_slot,
            l_batch.states,
            l_batch.owner(),
            len(locality),
        )
        out[name]["worst_anchor_clears_worst_negative"] = clears_negatives(V, roll, same_prompt)
        print(name, json.dumps(out[name]), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    from safetensors.torch import load_file

    from aloe_build.data import load_edits
    from aloe_build.models import load_model
    from aloe_build.states import collect_states
    from aloe_build.tokens import encode_prompt
    from aloe_kernels import AloeOperator
    from aloe_kernels.reading import attach_reading

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--operator", required=True, help="an operator directory with its build's checkpoints")
    ap.add_argument("--edits", required=True, help="the edit file it was built from")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--skip-invalid", action="store_true", help="drop invalid records, as the build did")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", default=None, help="write the result here as JSON")
    ap.add_argument("--stages", action="store_true", help="also read the raw, stage-2 and stage-4 addresses")
    args = ap.parse_args(argv)
    op = AloeOperator.load(args.operator)
    cal = load_file(str(Path(args.operator) / "checkpoints" / "5_calibrate.safetensors"))
    edits = load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid)
    if len(edits) != op.n:
        raise SystemExit(f"{len(edits)} edits but {op.n} slots: this reading needs one slot per edit")
    model, tok = load_model(args.model)
    attach_reading(model, op.reading_decay)  # the states the operator's gates read
    rephrases = [(i, p) for i, e in enumerate(edits) for p in e.rephrases]
    locality = [x.prompt for e in edits for x in e.locality]
    r_ids = [encode_prompt(tok, p) for _, p in rephrases]
    r_states = collect_states(model, tok, r_ids, op.layer, [[len(s) - 1] for s in r_ids], desc="rewordings").states
    l_batch = collect_states(model, tok, [encode_prompt(tok, p) for p in locality], op.layer, desc="locality prompts")
    result = separability(
        op.addresses.float(),
        cal["worst_positive"].float(),
        cal["worst_negative"].float(),
        r_states,
        torch.tensor([i for i, _ in rephrases], dtype=torch.long),
        l_batch.states,
        l_batch.owner(),
        len(locality),
    )
    if args.stages:
        result["stages"] = _stages(args.operator, model, tok, edits, op.layer, r_states, rephrases, locality, l_batch)
    result = {"operator": args.operator, "edits": args.edits, "limit": args.limit, **result}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
