"""How many positions of each request the write stages (6 and 8) run through the layers above the edit.

    python -m benchmarks.upper_pass_positions --edits runs/cf-stream.jsonl --limit 839 --steps 2 \\
        --operator runs/cf839 --operator runs/cf7819

The write stages cache the upper layers' keys and values before each sequence's first open gate
(of any slot) and run only the positions after it. With more edits in the operator, more slots can
open earlier on a request and leave fewer positions cached. For the first ``--limit`` requests of
an edit file (prompt plus its target, as stage 6 scores them), each operator's
:class:`aloe_build.edited_forward.EditedForward` is built, and this prints the positions that reach
the upper layers, the mean first open position (any slot, and the request's own slot) and the
slots open per request.

Stage 6 runs its steps on batches of ``target_batch`` requests, and each step pads a batch to its
longest run of positions after the cache. The padded positions are printed for batches formed by
whole length (the earlier order) and as stage 6 forms them; ``--steps K`` also times K forward and
backward passes of every batch with a write delta through the request's own gate, as a stage-6 step
computes them.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from aloe_build import load_model
from aloe_build.config import BuildConfig
from aloe_build.edited_forward import EditedForward
from aloe_build.tokens import encode_prompt
from aloe_build.writes import target_batches
from aloe_kernels import AloeOperator


def _first_open(gates: torch.Tensor, length: int) -> int:
    rows = (gates > 0).any(1).nonzero() if gates.numel() else torch.empty(0, 1)
    return int(rows[0, 0]) if rows.numel() else length


def _time_steps(fwd: EditedForward, steps: int, target_batch: int) -> None:
    """Padded positions and seconds per stage-6 step, with batches by whole length (the earlier
    order) and as stage 6 forms them (``target_batches``: by positions after the cache)."""
    by_length = sorted(range(len(fwd.seqs)), key=lambda i: len(fwd.seqs[i]))
    orders = {"by length": [by_length[k: k + target_batch] for k in range(0, len(by_length), target_batch)],
              "stage 6": target_batches(fwd, [[i] for i in range(len(fwd.seqs))], target_batch)}
    for name, batches in orders.items():
        padded = sum(len(b) * max(fwd.upper_positions(i) for i in b) for b in batches)
        line = (f"  {name}, {len(batches)} batches of {target_batch}: padded positions through the upper layers "
                f"{padded} ({padded / len(fwd.seqs):.2f} per request)")
        if steps:
            seconds = _step_seconds(fwd, batches, steps)
            quarter = max(1, len(batches) // 4)
            line += (f"; seconds per step, mean {sum(seconds) / len(seconds):.3f}, first quarter "
                     f"{sum(seconds[:quarter]) / quarter:.3f}, last quarter {sum(seconds[-quarter:]) / quarter:.3f}")
        print(line, flush=True)


def _step_seconds(fwd: EditedForward, batches: list[list[int]], steps: int) -> list[float]:
    """Seconds of one forward and backward pass per batch, a write delta through each request's own gate."""
    seconds = []
    torch.manual_seed(0)
    with fwd.frozen():
        for rows in batches:
            delta = torch.randn(len(rows), fwd.d_out, requires_grad=True)
            g = fwd.own_gates(rows)[..., None]
            t0 = time.perf_counter()
            for _ in range(steps):
                nll, _ = fwd.scored(rows, g * delta[:, None, :])
                nll.sum().backward()
            seconds.append((time.perf_counter() - t0) / steps)
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--edits", required=True, help="a JSONL edit file with prompt and target_new")
    p.add_argument("--limit", type=int, default=839)
    p.add_argument("--operator", action="append", required=True, help="a build directory (repeatable)")
    p.add_argument("--max-target-tokens", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="timed stage-6 steps per batch (0: none)")
    p.add_argument("--target-batch", type=int, default=BuildConfig().target_batch)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model, tok = load_model("smollm2", device="cpu")
    with open(a.edits) as f:
        recs = [json.loads(line) for line in f][: a.limit]
    seqs, target_lens = [], []
    for r in recs:
        target = tok.encode(" " + r["target_new"], add_special_tokens=False)[: a.max_target_tokens]
        seqs.append(encode_prompt(tok, r["prompt"]) + target)
        target_lens.append(len(target))
    tokens = sum(len(s) for s in seqs)
    for path in a.operator:
        op = AloeOperator.load(path)
        t0 = time.time()
        fwd = EditedForward(model, tok, seqs, target_lens, op, batch_size=32, owners=list(range(len(seqs))))
        upper = sum(len(s) - fwd.split[i] for i, s in enumerate(seqs))
        any_first = [_first_open(fwd.gates[i].gates, len(s)) for i, s in enumerate(seqs)]
        own_first = []
        for i, s in enumerate(seqs):
            hit = (fwd.gates[i].slots == i).nonzero()
            own = fwd.gates[i].gates[:, int(hit[0, 0])][:, None] if hit.numel() else torch.empty(0, 0)
            own_first.append(_first_open(own, len(s)))
        slots_open = sum(len(fwd.gates[i].slots) for i in range(len(seqs))) / len(seqs)
        print(f"{path}: n={op.n}, {len(seqs)} requests, {tokens} tokens; through the upper layers {upper} "
              f"({upper / tokens:.3f}); first open position, any slot {sum(any_first) / len(seqs):.2f}, own slot "
              f"{sum(own_first) / len(seqs):.2f}; slots open per request {slots_open:.2f} ({time.time() - t0:.0f} s)",
              flush=True)
        _time_steps(fwd, a.steps, a.target_batch)


if __name__ == "__main__":
    main()
