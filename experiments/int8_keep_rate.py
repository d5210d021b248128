"""How many edits the int8 address screen keeps on a real operator, and the address bytes that leaves.

States: the down-projection inputs at the operator's layer, at every token of prompts whose
facts the operator does not hold (the CounterFact records after its edits: their requests and
neighbourhood prompts), read with the unedited model. Each token is one decode step (T = 1);
consecutive runs of 32 tokens make a decode batch (T = 32), whose kept set is the union. Also on
the operator's own requests (its first 300, at the last token, where its edits open): every opening edit must be
kept. The bytes a decode step reads from the addresses, against the bf16 operator's n x d x 2:
the int8 values, the float16 scales and the kept rows in bf16 (rescored exactly).

    python -m experiments.int8_keep_rate OPERATOR_DIR --edits $DATA/counterfact/counterfact-val.json \\
        --start 1301 --records 100 --out benchmarks/results/int8_keep_rate_smollm2/n1301.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from aloe_build import load_edits, load_model
from aloe_build.tokens import encode_prompt
from aloe_kernels import AloeOperator
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.int8_addresses import GROUP, Int8Addresses
from aloe_kernels.reference import aloe_gates, normalize_rows

BATCH = 32
OWN_REQUESTS = 300  # the operator's first requests, read at their last token


def layer_inputs(model, tok, layer: int, prompts: list[str]) -> list[torch.Tensor]:
    """Down-projection inputs (tokens, d) at ``layer`` for each prompt, unedited model."""
    site = locate_down_proj(model, layer)
    seen: list[torch.Tensor] = []
    hook = site.module.register_forward_hook(lambda m, a, o: seen.append(a[0][0].detach().float()))
    try:
        with torch.no_grad():
            for p in prompts:
                model(torch.tensor([encode_prompt(tok, p)]))
    finally:
        hook.remove()
    return seen


def keep_stats(q: Int8Addresses, op: AloeOperator, units: torch.Tensor) -> dict:
    """Keep rates at T = 1 (each state alone) and T = 32 (union over consecutive states)."""
    may = q.may_open(units, op.addresses, op.thresholds, op.temperatures, op.gate_eps)  # (states, n)
    per_state = may.sum(dim=1).double() / op.n
    windows = [may[i : i + BATCH].any(dim=0).sum().item() / op.n for i in range(0, may.shape[0] - BATCH + 1, BATCH)]
    bf16 = op.n * op.d * 2
    int8 = op.n * op.d + op.n * (-(-op.d // GROUP)) * 2
    mean1, mean32 = float(per_state.mean()), sum(windows) / max(1, len(windows))
    return {
        "states": int(units.shape[0]),
        "keep_rate_T1": mean1,
        "keep_rate_T1_max": float(per_state.max()),
        "keep_rate_T32": mean32,
        "keep_rate_T32_max": max(windows) if windows else None,
        "address_bytes_vs_bf16_T1": (int8 + mean1 * bf16) / bf16,
        "address_bytes_vs_bf16_T32": (int8 + mean32 * bf16) / bf16,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("operator")
    ap.add_argument("--edits", required=True, help="the stream the operator was built from (EasyEdit JSON)")
    ap.add_argument("--start", type=int, required=True, help="first record not in the operator")
    ap.add_argument("--records", type=int, default=100, help="held-out records whose prompts give states")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    t0 = time.time()
    op = AloeOperator.load(args.operator)
    q = Int8Addresses.quantize(op.addresses)
    model, tok = load_model(args.model)
    held = load_edits(args.edits, limit=args.start + args.records)[args.start :]
    prompts = [e.prompt for e in held] + [loc.prompt for e in held for loc in e.locality]
    units = normalize_rows(torch.cat(layer_inputs(model, tok, op.layer, prompts)), op.eps)
    own = [e["request"] for e in op.edits[:OWN_REQUESTS] if e.get("request")]
    last = torch.stack([s[-1] for s in layer_inputs(model, tok, op.layer, own)])
    opened = (aloe_gates(last, op) > 0).any(dim=0)
    units_own = normalize_rows(last, op.eps)
    kept = q.may_open(units_own, op.addresses, op.thresholds, op.temperatures, op.gate_eps).any(dim=0)
    out = {
        "operator": str(args.operator),
        "n": op.n,
        "d": op.d,
        "layer": op.layer,
        "held_out": f"{args.edits} records {args.start}-{args.start + args.records - 1}: requests and neighbourhood prompts",
        **keep_stats(q, op, units),
        "own_requests": len(own),
        "own_requests_edits_opening": int(opened.sum()),
        "own_requests_opening_edits_kept": int((opened & kept).sum()),
        "error_norm_over_address_norm_median": float((q.error_norms / torch.linalg.vector_norm(op.addresses, dim=1)).median()),
        "seconds": round(time.time() - t0, 1),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
