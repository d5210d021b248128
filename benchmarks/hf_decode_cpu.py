"""Hugging Face decoding on CPU with a built operator patched in, against the same model without.

Greedy generation of ``--tokens`` new tokens (exactly that many: ``min_new_tokens``) for a batch
of prompts, timed with ``apply_aloe`` and without in alternating rounds of the same process, the
order reversed every other round, so that machine noise hits both alike. Overhead = 1 -
median(patched tok/s) / median(base tok/s); paired overhead = 1 - median over rounds of
patched / base. Also reports the share of the prompts' token positions that open any gate
(the prompts and the gate statistics of ``benchmarks.serving.bench_vllm``).

    python -m benchmarks.hf_decode_cpu --operator runs/cf4000 --batch 1,8 --out benchmarks/results/hf_decode_cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from aloe_build.models import load_model
from aloe_kernels import AloeOperator, apply_aloe, remove_aloe
from benchmarks.serving.bench_vllm import PROMPTS, _open_stats, _states


def _generate(model, inputs: dict, tokens: int) -> float:
    """Seconds for one greedy generation of exactly ``tokens`` new tokens."""
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return time.perf_counter() - t


def _open_share(model, tok, op: AloeOperator, texts: list[str]) -> float:
    """Share of the prompts' token positions at which some gate of ``op`` opens."""
    return 1.0 - _open_stats(op, _states(model, tok, texts, op.layer))["open0"]


def measure(model, tok, op: AloeOperator, batch: int, tokens: int, rounds: int) -> dict:
    """Tokens/s of base and patched decoding, ``rounds`` alternating pairs after one warm-up each."""
    tok.padding_side = "left"
    texts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
    enc = tok(texts, return_tensors="pt", padding=True)
    inputs = {
        "input_ids": enc.input_ids,
        "attention_mask": enc.attention_mask,
        "pad_token_id": tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id,
    }
    samples: dict[str, list[float]] = {"base": [], "aloe": []}

    def run(name: str) -> float:
        if name == "aloe":
            apply_aloe(model, op)
        try:
            return _generate(model, inputs, tokens)
        finally:
            if name == "aloe":
                remove_aloe(model)

    run("base"), run("aloe")  # warm-up
    for r in range(rounds):
        for name in ("base", "aloe") if r % 2 == 0 else ("aloe", "base"):
            samples[name].append(batch * tokens / run(name))
    base, aloe = statistics.median(samples["base"]), statistics.median(samples["aloe"])
    paired = [a / b for a, b in zip(samples["aloe"], samples["base"])]
    return {
        "batch": batch,
        "tokens": tokens,
        "base_tok_per_s": round(base, 2),
        "aloe_tok_per_s": round(aloe, 2),
        "overhead_pct": round(100 * (1 - aloe / base), 2),
        "paired_overhead_pct": round(100 * (1 - statistics.median(paired)), 2),
        "samples": samples,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--operator", required=True, help="an operator built by `aloe build` for the model")
    ap.add_argument("--batch", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", required=True, help="writes <out>.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    op = AloeOperator.load(args.operator)
    result = {
        "model": args.model,
        "operator": args.operator,
        "n_edits": op.n,
        "layer": op.layer,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "prompt_positions_open": _open_share(model, tok, op, PROMPTS),
        "runs": [],
    }
    for b in [int(x) for x in args.batch.split(",") if x]:
        row = measure(model, tok, op, b, args.tokens, args.rounds)
        result["runs"].append(row)
        print(
            f"batch {b}: base {row['base_tok_per_s']:.1f} tok/s, ALOE ({op.n} edits) {row['aloe_tok_per_s']:.1f} "
            f"tok/s, overhead {row['overhead_pct']:.2f}% (paired {row['paired_overhead_pct']:.2f}%)",
            flush=True,
        )
    out = Path(f"{args.out}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
