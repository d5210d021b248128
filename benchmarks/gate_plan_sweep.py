"""Sweep the gate kernel's launch plan at decode on a GPU (T = 1, Llama-3-8B down-projection, bf16).

    python3 -m benchmarks.gate_plan_sweep        # on a CUDA machine; writes $OUT (or /tmp)/sweep_gate.json

For n = 1,301 and 10,000 edits (the ``gate`` part's T = 1 workloads of
:func:`benchmarks.bench_gate.make_workload`: one gate open), times the automatic plan and
explicit ``split`` (edit ranges) x ``k_split`` (d slices) x (BLOCK_N, BLOCK_D)
overrides of :func:`aloe_kernels.ops.aloe_gate.aloe_gate_residual_` as CUDA-graph
replays with L2 flushed, against the address-read floor at the copy bandwidth
measured in the same run. Prints the 12 fastest per n. ``SWEEP_BUDGET_S``
(default 200) bounds the time spent.
"""

import itertools
import json
import os
import statistics
import time

import torch

from aloe_kernels.ops.aloe_gate import aloe_gate_residual_
from benchmarks.bench_gate import make_workload
from benchmarks.gpu.timing import GraphTimer


def main() -> None:
    timer = GraphTimer()
    bw = timer.copy_bandwidth_gbps()
    print(f"copy bw {bw:.0f} GB/s", flush=True)
    rows = []
    t0 = time.time()
    for n in (1301, 10000):
        w = make_workload("llama3-8b", 1, n, "1", torch.bfloat16, "cuda", seed=n + 1, gen_device="cuda")
        h, op = w.h, w.op
        y = torch.zeros(1, w.d_out, device="cuda", dtype=torch.bfloat16)
        floor = op.addresses.numel() * op.addresses.element_size() / (bw * 1e3)
        cands = [dict()]
        for split, ks in itertools.product((33, 66, 132, 264, 528), (1, 2, 4, 8)):
            for bn, bd in ((16, 256), (32, 256), (32, 128), (64, 128)):
                cands.append(dict(split=split, k_split=ks, block_t=16, block_n=bn, block_d=bd, block_o=64))
        for kw in cands:
            if time.time() - t0 > float(os.environ.get("SWEEP_BUDGET_S", 200)):
                break
            try:
                graph = timer.capture(lambda: aloe_gate_residual_(y, h, op.addresses, op.thresholds, op.temperatures,
                                                                  op.writes, op.eps, op.gate_eps, **kw))
                us = statistics.median(timer.replay_us(graph, 15))
            except Exception as exc:
                print(n, kw, "failed", type(exc).__name__, str(exc)[:100], flush=True)
                continue
            rows.append(dict(n=n, us=us, pct=100 * floor / us, **kw))
        best = sorted([r for r in rows if r["n"] == n], key=lambda r: r["us"])
        auto = next(r for r in rows if r["n"] == n and "split" not in r)
        print(f"n={n} floor {floor:.1f} us; auto {auto['us']:.1f} us ({auto['pct']:.0f}%)", flush=True)
        for r in best[:12]:
            print("  ", json.dumps(r), flush=True)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "sweep_gate.json"), "w") as f:
        json.dump({"bw": bw, "rows": rows}, f)


if __name__ == "__main__":
    main()
