"""Stage 7 on a build's checkpoints: time, memory and the writes of the open-gate ridge solve.

    python -m benchmarks.ridge_cost runs/cf1301            # a build directory with stages 3-7 checkpointed
    python -m benchmarks.ridge_cost runs/cf1301 --dense    # also the dense-Gram formula (small n only)

The writes are compared with the build's own stage-7 checkpoint (made by whatever code built it)
and, with ``--dense``, with paper Eq. 6 written out over the dense gate matrices. Peak memory is the
rise of the process's resident-set high-water mark over the loaded checkpoints (Linux).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from aloe_build.config import BuildConfig
from aloe_build.writes import NegativeGateTally, gates_of, ridge_writes
from aloe_kernels import AloeOperator


def dense_ridge(Y, anchors, owner, negatives, op, cfg, chunk: int = 16384) -> torch.Tensor:
    """Paper Eq. 6 with every gate row in the Gram matrix, dense."""
    Gp = gates_of(anchors, op).double()
    target = Gp[torch.arange(len(owner)), owner][:, None] * Y.double()[owner]
    A = Gp.T @ Gp + cfg.ridge_mu * torch.eye(op.n, dtype=torch.float64)
    for part in negatives:
        for lo in range(0, part.shape[0], chunk):
            Gn = gates_of(part[lo: lo + chunk], op).double()
            A += cfg.ridge_lambda * (Gn.T @ Gn)
    return torch.linalg.solve(A, Gp.T @ target).float()


def _rss_gib(field: str) -> float:
    """VmRSS or VmHWM of this process, GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    raise RuntimeError(f"{field} not in /proc/self/status")


def _read_through(t: torch.Tensor, rows: int = 65536) -> None:
    """Read every page of a (memory-mapped) tensor, a block of rows at a time."""
    for lo in range(0, t.shape[0], rows):
        t[lo: lo + rows].sum()


def _reset_peak() -> None:
    """Reset VmHWM to the current RSS (Linux: 5 > /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build_dir")
    ap.add_argument("--dense", action="store_true", help="also solve with dense gate matrices (slow at large n)")
    args = ap.parse_args(argv)
    ckpt = Path(args.build_dir) / "checkpoints"
    roll = load_file(str(ckpt / "3_rollouts.safetensors"))
    for v in roll.values():  # resident, as in a build, before the peak is reset
        _read_through(v)
    cal = load_file(str(ckpt / "5_calibrate.safetensors"))
    Y = load_file(str(ckpt / "6_targets.safetensors"))["Y"]
    V = load_file(str(ckpt / "4_refine.safetensors"))["V"]
    built = ckpt / "7_ridge.safetensors"
    op = AloeOperator(addresses=V, thresholds=cal["tau"], temperatures=cal["alpha"], writes=torch.zeros(len(V), Y.shape[1]))
    cfg, negatives = BuildConfig(), [roll["pool"], roll["specific"]]
    base = _rss_gib("VmRSS")
    _reset_peak()
    t0 = time.perf_counter()
    tally = NegativeGateTally()
    U0 = ridge_writes(Y, roll["anchors"], roll["anchor_owner"], negatives, op, cfg, tally)
    seconds = time.perf_counter() - t0
    rise = _rss_gib("VmHWM") - base
    print(f"n={op.n} anchors={len(roll['anchors'])} negatives={tally.rows} "
          f"(open any gate: {tally.summary()['negative_any_open_share']:.4f})")
    print(f"open-gate ridge solve: {seconds:.1f} s, peak RSS rise {rise:.2f} GiB over {base:.2f} GiB loaded")
    scale = float(U0.abs().max())
    if built.exists():
        ref = load_file(str(built))["U0"]
        print(f"vs the build's stage-7 checkpoint: max |difference| {float((U0 - ref).abs().max()):.2e} "
              f"(max |U0| {scale:.2e})")
    if args.dense:
        t1 = time.perf_counter()
        dense = dense_ridge(Y, roll["anchors"], roll["anchor_owner"], negatives, op, cfg)
        print(f"dense formula: {time.perf_counter() - t1:.1f} s, max |difference| {float((U0 - dense).abs().max()):.2e}")


if __name__ == "__main__":
    main()
