"""Where the decode time of the gate kernel goes, kernel by kernel, on a GPU.

    python3 -m benchmarks.gate.gate_profile [--n 1301 10000 100000] [--T 1 32]   # on a CUDA machine

At decode (Llama-3-8B down-projection, bf16, one gate open per token: the
``gate`` part's workloads of :func:`benchmarks.gate.bench_gate.make_workload`;
T = 32 is a decode batch of 32), each variant is timed
twice: as a CUDA-graph replay with L2 flushed (what a serving engine sees), and
eagerly under ``torch.profiler`` for the device time of each kernel it launches.
The gap between the replay and the sum of its kernels is launch and dependency
latency; the kernels' own times show which launch misses the address-read floor
(address bytes at the copy bandwidth measured in the same run).

Variants: the automatic plan with a bf16 ``y`` (partial sums and a reduce
launch), the same without the d split (``k_split=1``), with a d split of 4, and
with one d_out slice (``o_split=1``), and the automatic plan with an fp32 ``y``
(relaxed atomics, no reduce); the cuBLAS score GEMM alone and the ungated
shrink+expand as baselines. Then the configuration the autotuner chose for each
key. Writes ``gate_profile.json`` under ``$OUT`` (or /tmp).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics

import torch

from aloe_kernels.ops.aloe_gate import aloe_gate_residual_
from aloe_kernels.ops.gate_kernels import jit_kernels
from aloe_kernels.ops.launch_plan import plan_launch, sm_count
from benchmarks.gate.bench_gate import make_workload
from benchmarks.gpu.timing import GraphTimer

PROFILE_REPS = 20


def _kernel_times(fn, flush: torch.Tensor) -> dict[str, float]:
    """Mean device microseconds per call of each kernel ``fn`` launches (the L2 flush left out)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(PROFILE_REPS):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    out = {}
    for ev in prof.key_averages():
        total = getattr(ev, "self_device_time_total", None)
        if total is None:
            total = ev.self_cuda_time_total
        if total <= 0 or "fill" in ev.key.lower() or "zero" in ev.key.lower():
            continue
        out[ev.key[:60]] = total / PROFILE_REPS
    return out


def _variants(w, T: int, n: int) -> dict:
    """name -> (callable, plan description) for one workload."""
    op, h = w.op, w.h
    y16 = torch.zeros(T, w.d_out, device="cuda", dtype=torch.bfloat16)
    y32 = torch.zeros(T, w.d_out, device="cuda", dtype=torch.float32)
    args = (h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps)
    sms = sm_count(h.device)
    d = op.addresses.shape[1]

    def gate(y, **kw):
        plan = plan_launch(T, n, w.d_out, y.dtype, False, sms, 0, d, kw.get("k_split", 0), kw.get("o_split", 0))
        desc = f"{plan.mode_name}, split {plan.split} x {plan.edits_per_split}, k_split {plan.k_split}, o_split {plan.o_split}"
        return (lambda: aloe_gate_residual_(y, *args, **kw)), desc

    vt = op.addresses.t()
    return {
        "aloe bf16 y (auto)": gate(y16),
        "aloe bf16 y, k_split=1": gate(y16, k_split=1),
        "aloe bf16 y, k_split=4": gate(y16, k_split=4),
        "aloe bf16 y, o_split=1": gate(y16, o_split=1),
        "aloe fp32 y (auto)": gate(y32),
        "cuBLAS scores h V^T": ((lambda: torch.mm(h, vt)), "one GEMM"),
        "shrink+expand (h V^T) U": ((lambda: torch.mm(torch.mm(h, vt), op.writes)), "two GEMMs"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, nargs="+", default=[1301, 10000, 100000])
    p.add_argument("--T", type=int, nargs="+", default=[1])
    a = p.parse_args()
    timer = GraphTimer()
    bw = timer.copy_bandwidth_gbps()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {bw:.0f} GB/s (read + written)", flush=True)
    rows = []
    for T, n in itertools.product(a.T, a.n):
        w = make_workload("llama3-8b", T, n, "1", torch.bfloat16, "cuda", seed=n + 1, gen_device="cuda")
        floor = w.op.addresses.numel() * w.op.addresses.element_size() / (bw * 1e3)
        print(f"\nT={T} n={n}: address-read floor {floor:.1f} us", flush=True)
        for name, (fn, desc) in _variants(w, T, n).items():
            us = statistics.median(timer.replay_us(timer.capture(fn), 30))
            kernels = _kernel_times(fn, timer.flush)
            ksum = sum(kernels.values())
            rows.append(dict(T=T, n=n, variant=name, plan=desc, graph_us=us, floor_us=floor, kernels_us=kernels))
            print(f"  {name:28s} {us:8.1f} us  ({100 * floor / us:5.1f}% of floor)  [{desc}]", flush=True)
            print(f"      kernels sum {ksum:.1f} us; gaps {us - ksum:.1f} us", flush=True)
            for k, v in sorted(kernels.items(), key=lambda kv: -kv[1]):
                print(f"      {v:8.1f} us  {k}", flush=True)
        del w
        torch.cuda.empty_cache()
    tuned = autotuned_configs()
    print("\nautotuned configurations (key: t_bucket, n_bucket, d, d_out, ...):")
    for line in tuned:
        print("  " + line)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "gate_profile.json"), "w") as f:
        json.dump(
            {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "copy_bw_gbps": bw,
                "rows": rows,
                "autotuned": tuned,
            },
            f,
            indent=1,
        )


def autotuned_configs() -> list[str]:
    """One line per autotuning key seen in this run: the kernel, the key and the chosen configuration."""
    kernels = jit_kernels(False)
    lines = []
    for name in ("gate_tuned", "gate_tuned_ws", "scores_tuned"):
        for key, cfg in getattr(kernels[name], "cache", {}).items():
            lines.append(f"{name} {key}: {cfg}")
    return lines


if __name__ == "__main__":
    main()
