"""Exact screens for the CPU serving path, measured on a built operator and its own stage-3 states.

    python -m benchmarks.screen_bounds --operator runs/cf7819 [--states 4000] [--threads 1]

A screen is exact when an edit it drops cannot open: a cheap score plus a bound on its error stays
under the edit's open floor. For each screen this prints the share of (state, edit) pairs kept,
and the share of edits kept for a step of 32 states (the union over its tokens: the exact rescoring
runs on every edit that any token of the step keeps), on the states of the build's checkpoint
(``checkpoints/3_rollouts.safetensors``: corpus negatives, continuations of the requests, and the
requests' own anchor states):

- ``bf16``: the served screen (:func:`aloe_kernels.screened.screen_limit`), and the same with the
  margin of a unit address (what it used before), with the open pairs each drops;
- ``lowrank-r``: scores in the top ``r`` principal directions of the addresses, bounded by
  ``|address residual| * |h residual|`` (Cauchy-Schwarz on the orthogonal complement);
- ``int8``: addresses rounded per row to 255 or 127 levels, the normalised h to 128 or 256
  levels per state or per step, bounded by ``s_v/2 |h|_1 + s_h/2 |v_q|_1``;
- ``int8 served``: the served int8 screen itself (:class:`aloe_kernels.screened_int8.Int8Screen`:
  127-level addresses, 256 levels per state, PyTorch's int8 linear), with the open pairs it drops.

It also times fp32 ``h @ V^T`` against PyTorch's dynamically quantised int8 linear (fbgemm), and
the whole residual on the fp32 path (``sparse_residual_``) against the int8-screened one, at
T = 1 and 32 on the operator's states.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from safetensors import safe_open

from aloe_kernels.operator import AloeOperator
from aloe_kernels.reference import open_score_floor
from aloe_kernels.residual import sparse_residual_
from aloe_kernels.screened import SCREEN_MARGIN, screen_limit
from aloe_kernels.screened_int8 import Int8Screen, int8_screened_residual_

STEP_TOKENS = 32


def _sample(file: Path, name: str, k: int, gen: torch.Generator) -> torch.Tensor:
    with safe_open(str(file), "pt") as f:
        rows = f.get_slice(name)
        total = rows.get_shape()[0]
        idx = torch.randperm(total, generator=gen)[: min(k, total)].sort().values.tolist()
        return torch.stack([rows[i: i + 1][0] for i in idx]).float()


def _kept(keep: torch.Tensor) -> tuple[float, float]:
    """(share of pairs kept, mean share of edits kept per step of STEP_TOKENS states)."""
    steps = keep[: keep.shape[0] // STEP_TOKENS * STEP_TOKENS].reshape(-1, STEP_TOKENS, keep.shape[1])
    return float(keep.float().mean()), float(steps.any(dim=1).float().mean())


def _screens(V: torch.Tensor, thr: torch.Tensor, temp: torch.Tensor, gate_eps: float, served: Int8Screen) -> dict:
    """name -> function of normalised states (S, d) giving (keep (S, n) bool, note); ``served`` is the
    int8 screen prepared for these addresses."""
    floor = open_score_floor(thr, temp, gate_eps)
    out = {}

    def bf16(limit):
        def screen(H):
            keep = (H.to(torch.bfloat16) @ V.to(torch.bfloat16).T) > limit[None, :]
            dropped = ((H @ V.T) > floor[None, :]) & ~keep
            return keep, f"open pairs dropped {int(dropped.sum())}"
        return screen

    out["bf16"] = bf16(screen_limit(V, thr, temp, gate_eps))
    out["bf16, unit-address margin"] = bf16((floor - SCREEN_MARGIN).to(torch.bfloat16))
    evecs = torch.linalg.eigh((V.T @ V).double())[1].flip(1).float()
    for r in (128, 256, 384):
        P = evecs[:, :r]
        Vr = V @ P
        v_res = (V - Vr @ P.T).norm(dim=1)

        def lowrank(H, P=P, Vr=Vr, v_res=v_res):
            Hr = H @ P
            h_res = (H - Hr @ P.T).norm(dim=1)
            return (Hr @ Vr.T + h_res[:, None] * v_res[None, :]) > floor[None, :], ""
        out[f"lowrank-{r}"] = lowrank
    # (address levels, h levels, h range per step): 8-bit addresses with 7- or 8-bit h per state, and
    # 7-bit addresses with 8-bit h over each step of 32 states (the per-tensor scale of a dynamically
    # quantised linear, and no int16 overflow in AVX2's u8 x s8 pair products: 2 * 255 * 64 < 2^15)
    for v_levels, h_levels, per_step in ((127, 127, False), (127, 255, False), (63, 255, True)):
        s_v = V.abs().amax(dim=1) / v_levels
        Vq = torch.round(V / s_v[:, None]).clamp(-v_levels, v_levels) * s_v[:, None]
        vq_l1 = Vq.abs().sum(dim=1)

        def int8(H, h_levels=h_levels, per_step=per_step, s_v=s_v, Vq=Vq, vq_l1=vq_l1):
            if per_step:
                lo = H.reshape(-1, STEP_TOKENS * H.shape[1]).amin(dim=1).repeat_interleave(STEP_TOKENS)[:, None]
                hi = H.reshape(-1, STEP_TOKENS * H.shape[1]).amax(dim=1).repeat_interleave(STEP_TOKENS)[:, None]
            else:
                lo, hi = H.amin(dim=1, keepdim=True), H.amax(dim=1, keepdim=True)
            s_h = (hi - lo) / h_levels
            Hq = torch.round((H - lo) / s_h) * s_h + lo
            bound = (s_v[None, :] / 2) * H.abs().sum(1, keepdim=True) + (s_h / 2) * vq_l1[None, :]
            return (Hq @ Vq.T + bound) > floor[None, :], ""
        name = f"int8: address {2 * v_levels + 1} levels, h {h_levels + 1} " + ("per step" if per_step else "per state")
        out[name] = int8
    def int8_served(H):
        keep = torch.zeros(H.shape[0], V.shape[0], dtype=torch.bool)
        for i in range(0, H.shape[0], STEP_TOKENS):  # one call per step, as served
            score, slack = served.bounds(H[i: i + STEP_TOKENS])
            keep[i: i + STEP_TOKENS] = score + slack >= floor[None, :]
        dropped = ((H @ V.T) > floor[None, :]) & ~keep
        return keep, f"open pairs dropped {int(dropped.sum())}"
    out["int8 served"] = int8_served
    return out


def _timings(op: AloeOperator, screen: Int8Screen, states: torch.Tensor, reps: int = 20) -> dict:
    """Milliseconds per call: the address product alone (fp32, int8), and the whole residual on each path."""
    V = op.addresses
    lin = torch.nn.Linear(V.shape[1], V.shape[0], bias=False)
    lin.weight.data.copy_(V)
    q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
    out = {}
    for T in (1, STEP_TOKENS):
        h = torch.randn(T, V.shape[1])
        for name, fn in (("fp32", lin), ("int8 dynamic", q)):
            with torch.no_grad():
                fn(h)
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn(h)
            out[f"T={T} {name} ms"] = round((time.perf_counter() - t0) / reps * 1e3, 2)
    for T in (1, STEP_TOKENS):
        paths = {"residual fp32": lambda y, h: sparse_residual_(y, h, op),
                 "residual int8-screened": lambda y, h: int8_screened_residual_(
                     y, h, screen, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps)}
        for name, fn in paths.items():
            steps = [states[i: i + T] for i in range(0, min(len(states), reps * T), T)]
            fn(torch.zeros(T, op.d_out), steps[0])
            t0 = time.perf_counter()
            for h in steps:
                fn(torch.zeros(T, op.d_out), h)
            out[f"T={T} {name} ms"] = round((time.perf_counter() - t0) / len(steps) * 1e3, 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--operator", type=Path, required=True, help="a build directory (aloe_operator.safetensors, "
                   "aloe_config.json, checkpoints/3_rollouts.safetensors)")
    p.add_argument("--states", type=int, default=4000, help="states sampled of each kind")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    gen = torch.Generator().manual_seed(a.seed)
    op = AloeOperator.load(a.operator).to(dtype=torch.float32)
    V, thr, temp, gate_eps = op.addresses, op.thresholds, op.temperatures, op.gate_eps
    served = Int8Screen.prepare(V, thr, temp, gate_eps)
    ckpt = a.operator / "checkpoints" / "3_rollouts.safetensors"
    kinds = {"corpus negatives": "pool", "continuations": "continuations", "requests (anchors)": "anchors"}
    k = a.states // STEP_TOKENS * STEP_TOKENS
    states = {name: torch.nn.functional.normalize(_sample(ckpt, v, k, gen), dim=1) for name, v in kinds.items()}
    norms = V.norm(dim=1)
    result = {"operator": str(a.operator), "n": V.shape[0], "address_norm_min_median_max":
              [round(float(x), 1) for x in (norms.min(), norms.median(), norms.max())], "screens": {}}
    print(f"{a.operator}: n={V.shape[0]}, address norms {result['address_norm_min_median_max']}")
    print(f"  {'screen':46s} {'states':20s} share of pairs kept / of edits kept per step of {STEP_TOKENS}")
    for name, screen in _screens(V, thr, temp, gate_eps, served).items():
        row = {}
        for kind, H in states.items():
            keep, note = screen(H)
            pairs, per_step = _kept(keep)
            row[kind] = {"pairs_kept": pairs, "edits_kept_per_step": per_step, "note": note}
            print(f"  {name:46s} {kind:20s} {pairs:.6f} / {per_step:.4f} {note}", flush=True)
        result["screens"][name] = row
    result["timings"] = _timings(op, served, states["continuations"])
    print("  timings:", result["timings"])
    print(json.dumps(result))


if __name__ == "__main__":
    main()
