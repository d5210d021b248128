"""Stage 7 on a build's checkpoints: the ridge solve through the open gates against the dense Gram.

    python -m benchmarks.ridge_cost runs/cf1301      # a build directory with stages 3-6 checkpointed
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from aloe_build.config import BuildConfig
from aloe_build.writes import gates_in_chunks, gates_of, ridge_writes
from aloe_kernels import AloeOperator


def dense_ridge(Y, anchors, owner, negatives, op, cfg) -> torch.Tensor:
    """Paper Eq. 6 with every negative's gate row in the Gram matrix (the solve before the sparse one)."""
    Gp = gates_of(anchors, op).double()
    target = Gp[torch.arange(len(owner)), owner][:, None] * Y.double()[owner]
    A = Gp.T @ Gp + cfg.ridge_mu * torch.eye(op.n, dtype=torch.float64)
    for Gn in gates_in_chunks(negatives, op):
        A += cfg.ridge_lambda * (Gn.double().T @ Gn.double())
    return torch.linalg.solve(A, Gp.T @ target).float()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build_dir")
    ckpt = Path(ap.parse_args(argv).build_dir) / "checkpoints"
    roll = load_file(str(ckpt / "3_rollouts.safetensors"))
    cal = load_file(str(ckpt / "5_calibrate.safetensors"))
    Y = load_file(str(ckpt / "6_targets.safetensors"))["Y"]
    V = load_file(str(ckpt / "4_refine.safetensors"))["V"]
    op = AloeOperator(addresses=V, thresholds=cal["tau"], temperatures=cal["alpha"], writes=torch.zeros(len(V), Y.shape[1]))
    cfg, negatives = BuildConfig(), [roll["pool"], roll["specific"]]
    t0 = time.perf_counter()
    sparse = ridge_writes(Y, roll["anchors"], roll["anchor_owner"], negatives, op, cfg)
    t1 = time.perf_counter()
    dense = dense_ridge(Y, roll["anchors"], roll["anchor_owner"], negatives, op, cfg)
    t2 = time.perf_counter()
    print(f"n={op.n} negatives={sum(len(x) for x in negatives)} open-gate solve {t1 - t0:.1f} s, dense {t2 - t1:.1f} s, "
          f"max |difference| {float((sparse - dense).abs().max()):.2e}")


if __name__ == "__main__":
    main()
