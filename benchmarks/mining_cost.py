"""The cost of one re-mining of stage 4 at a stream's shape: a full pass over every shared negative
against a pass over each slot's candidates, on random unit states (the cost does not depend on
their values), timed in one process.

    python -m benchmarks.mining_cost --slots 7819 --shared 222000 --specific 100000

``--shared``: the pool plus every slot's anchors and request continuations (about 58,000 + 21 per
edit on the CounterFact stream); ``--specific``: own negatives (only their count per slot matters
for the candidate pass, so a part of them is enough).
"""

from __future__ import annotations

import argparse
import time

import torch

from aloe_build.addresses import NegativeSet
from aloe_build.config import BuildConfig


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, required=True)
    ap.add_argument("--shared", type=int, required=True)
    ap.add_argument("--specific", type=int, default=100_000)
    ap.add_argument("--dim", type=int, default=1536, help="state width (SmolLM2's intermediate size)")
    ap.add_argument("--repeats", type=int, default=1)
    args = ap.parse_args(argv)
    cfg = BuildConfig()
    g = torch.Generator().manual_seed(0)

    def unit(rows: int) -> torch.Tensor:
        return torch.nn.functional.normalize(torch.randn(rows, args.dim, generator=g), dim=1)

    n = args.slots
    negatives = NegativeSet(unit(args.shared), torch.randint(-1, n, (args.shared,), generator=g),
                            unit(args.specific), torch.randint(0, n, (args.specific,), generator=g))
    same = torch.eye(n, dtype=torch.bool)
    V = 15.0 * unit(n)
    print(f"n={n} shared={args.shared} specific={args.specific} d={args.dim} "
          f"k={cfg.refine_hard_negatives} candidates={cfg.refine_candidates} threads={torch.get_num_threads()}")
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        full_s, _ = negatives.top(V, same, cfg.refine_hard_negatives)
        t1 = time.perf_counter()
        cand = negatives.shared_candidates(V, same, cfg.refine_candidates)[1]
        t2 = time.perf_counter()
        cand_s, _ = negatives.top(V, same, cfg.refine_hard_negatives, candidates=cand)
        t3 = time.perf_counter()
        # the same addresses: the index holds the full top (up to the order of summation)
        torch.testing.assert_close(cand_s, full_s, rtol=1e-5, atol=1e-5)
        print(f"full re-mining {t1 - t0:.1f} s; candidate index {t2 - t1:.1f} s; re-mining from the index "
              f"{t3 - t2:.1f} s ({(t3 - t2) / (t1 - t0):.3f} of a full one)", flush=True)


if __name__ == "__main__":
    main()
