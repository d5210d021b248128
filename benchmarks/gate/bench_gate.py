"""Microbenchmark of the ALOE gate: U g(h) added into a down-projection output.

Providers
---------
- ``aloe_triton``      the fused Triton kernel (CUDA only; the CPU interpreter is
                       not a timing target, so it is skipped there with a reason);
- ``aloe_triton_det``  the same kernel in deterministic mode (CUDA only);
- ``reference``        the unfused PyTorch spec, ``y += aloe_reference(h, op)``;
- ``reference_compiled`` torch.compile of the same math (dynamic shapes; a
                       compile failure is reported, not fatal);
- ``dense_lowrank``    two matmuls ``(h @ V^T) @ U`` into y, no norm, no gate:
                       what a rank-n LoRA would cost;
- ``cublas_scores``    the score GEMM ``h @ V^T`` alone (the prefill yardstick);
- ``sparse``           ``aloe_kernels.residual.sparse_residual_``, the CPU path.

Workloads
---------
``active`` edits open per token, planted exactly: tokens are put into groups
sharing a direction, and each group owns a block of ``active`` edits whose
addresses lie near that direction (cosine ~0.9, open-score floor ~0.57); every
other edit has a random address (cosine ~0) and stays closed. ``active='all'``
opens every edit for every token. The measured mean number of open edits per
token is reported next to the requested one.

Metrics
-------
- ``median_ms`` (and ``min_ms``);
- the byte floor: what any implementation must move, i.e. the addresses (always),
  thresholds and temperatures, the write rows of edits open for some token, h,
  and y (read + write); ``gbps`` = floor bytes / time;
- ``pct_of_floor``: the floor's time at the device's memory bandwidth divided by
  the measured time (100% = speed of light). The bandwidth is the spec value
  for known GPUs, and is measured (a large read) on CPU;
- ``tflops``: useful flops (2 T n d for the scores + 2 T active d_out for the
  writes) / time, the same numerator for every provider;
- ``speedup_vs_<provider>``: that provider's time / this one's, per workload.

Results go to ``<out>.csv``, ``<out>.json`` (with device, versions and CPU/GPU
model) and ``<out>.png`` (written by :mod:`benchmarks.gate.bench_gate_report`). Run
``python -m benchmarks.gate.bench_gate --help``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from benchmarks.gate.bench_gate_report import summarize, write_results

# (d, d_out); "tiny" is for smoke runs on CPU (not in --shapes all).
SHAPES = {"smollm2": (1536, 576), "llama3-8b": (14336, 4096), "tiny": (48, 24)}
GPU_T = [1, 16, 64, 256, 2048, 8192]
GPU_N = [1301, 10000, 100000]
GPU_ACTIVE = ["0", "1", "10%"]
CPU_T = [1, 16, 64, 256]
CPU_N = [1301, 10000]
CPU_ACTIVE = ["0", "1", "10%", "all"]
QUICK_T = [1, 16]
QUICK_N = [10000]
QUICK_ACTIVE = ["0", "1", "all"]
PROVIDERS = ["aloe_triton", "aloe_triton_det", "reference", "reference_compiled", "dense_lowrank", "cublas_scores", "sparse"]
# HBM bandwidth (GB/s) by GPU name fragment, for pct_of_floor.
GPU_BANDWIDTH = {
    "H200": 4800.0,
    "H100 SXM": 3350.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "H100": 3350.0,
    "A100-SXM4-80GB": 2039.0,
    "A100": 1555.0,
    "L40S": 864.0,
    "L4": 300.0,
    "A10G": 600.0,
}
TAU, ALPHA = 0.8, 30.0
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "results"


# ---------------------------------------------------------------- workload
@dataclass
class Workload:
    shape: str
    T: int
    n: int
    active: str
    d: int
    d_out: int
    h: torch.Tensor
    op: object
    active_per_token: float  # requested
    open_edits: int  # edits open for at least one token (measured)
    measured_active: float  # mean open edits per token (measured)


def _active_count(spec: str, n: int) -> int:
    if spec == "all":
        return n
    if spec.endswith("%"):
        return max(1, int(round(float(spec[:-1]) / 100.0 * n)))
    return min(int(spec), n)


def make_workload(
    shape: str, T: int, n: int, active: str, dtype: torch.dtype, device: str, seed: int = 0, gen_device: str = "cpu"
):
    """One workload; ``gen_device="cuda"`` draws it on the GPU (seconds instead of minutes at n=100,000)."""
    from aloe_kernels import AloeOperator

    d, d_out = SHAPES[shape]
    gen = torch.Generator(device=gen_device).manual_seed(seed)
    a = _active_count(active, n)

    def randn(*size):
        return torch.randn(*size, generator=gen, device=gen_device)

    def unit(rows):
        return torch.nn.functional.normalize(randn(rows, d), dim=1)

    addresses = unit(n)
    thresholds = torch.full((n,), TAU, device=gen_device)
    if active == "all":
        thresholds.fill_(-5.0)
        h = randn(T, d)
    elif a == 0:
        h = randn(T, d)
    else:
        groups = max(1, min(T, n // a))
        centers = unit(groups)
        gid = torch.arange(T, device=gen_device) % groups
        h = centers[gid] + 0.3 * unit(T)
        for g in range(groups):
            rows = slice(g * a, (g + 1) * a)
            addresses[rows] = torch.nn.functional.normalize(centers[g] + 0.3 * unit(a), dim=1)
    h = h * 3.0  # activations are not unit vectors; the gate normalises anyway
    op = AloeOperator(
        addresses=addresses,
        thresholds=thresholds,
        temperatures=torch.full((n,), ALPHA, device=gen_device),
        writes=randn(n, d_out) / math.sqrt(d_out),
    )
    op = op.to(device=device, dtype=dtype)
    h = h.to(device=device, dtype=dtype)
    open_any, per_token = _measure_activity(h, op)
    return Workload(shape, T, n, active, d, d_out, h, op, float(a), open_any, per_token)


def _measure_activity(h, op, chunk: int = 8192):
    from aloe_kernels.reference import open_score_floor

    hc = h.float()
    hbar = hc / torch.linalg.vector_norm(hc, dim=1, keepdim=True).clamp_min(op.eps)
    floor = open_score_floor(op.thresholds, op.temperatures, op.gate_eps).float()
    open_any = torch.zeros(op.n, dtype=torch.bool, device=h.device)
    total = 0
    for lo in range(0, op.n, chunk):
        s = hbar @ op.addresses[lo : lo + chunk].float().T
        m = s > floor[lo : lo + chunk]
        open_any[lo : lo + chunk] = m.any(0)
        total += int(m.sum())
    return int(open_any.sum()), total / max(1, h.shape[0])


def workload_bytes(w: Workload, dtype: torch.dtype) -> dict:
    es = torch.tensor([], dtype=dtype).element_size()
    T, n, d, d_out = w.T, w.n, w.d, w.d_out
    floor = n * d * es + 2 * n * es + w.open_edits * d_out * es + T * d * es + 2 * T * d_out * es
    flops = 2.0 * T * n * d + 2.0 * T * w.measured_active * d_out
    return {"floor_bytes": floor, "useful_flops": flops}


def estimate_memory(shape: str, T: int, n: int, dtype: torch.dtype) -> int:
    """Peak bytes of one workload with the unfused reference (operator, fp32 copies, T x n temporaries)."""
    d, d_out = SHAPES[shape]
    es = torch.tensor([], dtype=dtype).element_size()
    op = n * (d + d_out + 2) * es
    fp32_copies = 0 if dtype == torch.float32 else n * (d + d_out) * 4
    scores = 4 * T * n * 4
    return op + fp32_copies + scores + 4 * T * (d + d_out) * 4


# ---------------------------------------------------------------- providers
def _reference_math(y, h, A, thr, temp, W, eps: float, geps: float):
    from aloe_kernels.reference import gates_from_scores

    hc = h.float()
    norm = torch.linalg.vector_norm(hc, dim=-1, keepdim=True).clamp_min(eps)
    s = (hc / norm) @ A.float().T
    g = gates_from_scores(s, thr.float(), temp.float(), geps)
    return y.add_((g @ W.float()).to(y.dtype))


_COMPILED: dict = {}


def build_providers(w: Workload, device: str, names: list[str], skipped: dict) -> dict[str, Callable]:
    from aloe_kernels import aloe_reference
    from aloe_kernels.residual import sparse_residual_

    op, h = w.op, w.h
    y = torch.zeros(w.T, w.d_out, device=device, dtype=h.dtype)
    out: dict[str, Callable] = {}
    for name in names:
        if name in ("aloe_triton", "aloe_triton_det"):
            if device != "cuda":
                skipped[name] = "the fused kernel is timed on CUDA only (on CPU it runs in the Triton interpreter)"
                continue
            try:
                from aloe_kernels.ops.aloe_gate import aloe_gate_residual_
            except Exception as exc:  # pragma: no cover - no triton
                skipped[name] = f"kernel unavailable: {exc!r}"
                continue
            det = name.endswith("_det")
            out[name] = lambda det=det: aloe_gate_residual_(
                y, h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps, det
            )
        elif name == "aloe_stream":
            if device != "cuda":
                skipped[name] = "the fused kernel is timed on CUDA only (on CPU it runs in the Triton interpreter)"
                continue
            from aloe_kernels.ops.stream_gate import STREAM_MAX_TOKENS, run_stream_gate

            if w.T > STREAM_MAX_TOKENS:
                skipped[name] = f"the streaming decode kernel takes at most {STREAM_MAX_TOKENS} tokens"
                continue
            out[name] = lambda: run_stream_gate(
                y, h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps
            )
        elif name == "aloe_stream_int8":
            if device != "cuda" or w.T > 32:
                skipped[name] = "the streaming decode kernel with int8 addresses: CUDA, at most 32 tokens"
                continue
            from aloe_kernels.int8_addresses import kernel_screen
            from aloe_kernels.ops.stream_gate import run_stream_gate

            screen = kernel_screen(op)
            out[name] = lambda screen=screen: run_stream_gate(
                y, h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps, screen=screen
            )
        elif name == "reference":
            out[name] = lambda: y.add_(aloe_reference(h, op))
        elif name == "reference_compiled":
            if name in skipped:
                continue
            fn = _COMPILED.get(device)
            if fn is None:
                fn = _COMPILED[device] = torch.compile(_reference_math, dynamic=True)
            args = (y, h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps)
            try:
                t0 = time.perf_counter()
                fn(*args)
                dt = time.perf_counter() - t0
                if dt > 1.0:
                    print(f"  (torch.compile of the reference took {dt:.1f} s for this shape)")
            except Exception as exc:
                skipped[name] = f"torch.compile failed: {type(exc).__name__}: {str(exc)[:200]}"
                print(f"  reference_compiled skipped: {skipped[name]}")
                continue
            out[name] = lambda fn=fn, args=args: fn(*args)
        elif name == "dense_lowrank":
            A, W = op.addresses, op.writes
            out[name] = lambda: y.addmm_(torch.mm(h, A.T), W)
        elif name == "cublas_scores":
            out[name] = lambda: torch.mm(h, op.addresses.T)
        elif name == "sparse":
            out[name] = lambda: sparse_residual_(y, h, op)
        else:
            raise ValueError(f"unknown provider {name!r}; choose from {PROVIDERS}")
    return out


# ---------------------------------------------------------------- timing
def time_cpu(
    fns: dict[str, Callable], reps: int, warmup: int = 2, min_s: float = 3.0, budget_s: float = 25.0, max_rounds: int = 200
) -> dict:
    """Interleaved timing: each round runs every provider once (rotating order).

    At least ``reps`` rounds, more (up to ``max_rounds``) until ``min_s`` seconds
    have passed, so fast workloads get many samples; stops after ``budget_s``.
    """
    for f in fns.values():
        for _ in range(warmup):
            f()
    times = {k: [] for k in fns}
    names = list(fns)
    start = time.perf_counter()
    r = 0
    while r < max_rounds:
        order = names[r % len(names) :] + names[: r % len(names)]
        for k in order:
            t0 = time.perf_counter()
            fns[k]()
            times[k].append(time.perf_counter() - t0)
        r += 1
        elapsed = time.perf_counter() - start
        if (r >= reps and elapsed > min_s) or (r >= 5 and elapsed > budget_s):
            break
    return {k: (statistics.median(v) * 1e3, min(v) * 1e3, len(v)) for k, v in times.items()}


def time_cuda(fns: dict[str, Callable], reps: int) -> dict:
    import triton.testing

    out = {}
    for k, f in fns.items():
        f()
        torch.cuda.synchronize()
        med, lo = triton.testing.do_bench(f, quantiles=[0.5, 0.0], rep=max(25, reps * 5))
        out[k] = (float(med), float(lo), reps)
    return out


def measure_bandwidth(device: str) -> tuple[float, str]:
    """Device memory bandwidth in GB/s and where the number comes from."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, bw in GPU_BANDWIDTH.items():
            if key in name:
                return bw, f"spec value for {key}"
        x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        import triton.testing

        ms = triton.testing.do_bench(lambda: y.copy_(x))
        return 2 * x.numel() / ms / 1e6, "measured device copy"
    x = torch.ones(64 * 1024 * 1024, dtype=torch.float32)  # 256 MiB
    best = math.inf
    for _ in range(7):
        t0 = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t0)
    return x.numel() * 4 / best / 1e9, "measured (best of 7 sums over 256 MiB)"


# ---------------------------------------------------------------- metadata
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment(device: str) -> dict:
    env = {
        "device": device,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
    try:
        env["loadavg"] = os.getloadavg()
    except OSError:
        pass
    return env


# ---------------------------------------------------------------- main
def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="bench_gate", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda when available")
    p.add_argument(
        "--dtype",
        choices=["fp32", "bf16", "fp16"],
        default=None,
        help="operator/activation dtype (default fp32 on CPU, bf16 on CUDA)",
    )
    p.add_argument("--shapes", choices=["smollm2", "llama3-8b", "all"], default=None, help="default: smollm2 on CPU, all on CUDA")
    p.add_argument("--T", type=int, nargs="+", default=None, help="token counts")
    p.add_argument("--n", type=int, nargs="+", default=None, help="edit counts")
    p.add_argument(
        "--active", nargs="+", default=None, help="open edits per token: an integer, a percentage of n like 10%%, or 'all'"
    )
    p.add_argument("--providers", nargs="+", default=None, choices=PROVIDERS)
    p.add_argument("--quick", action="store_true", help="a small subset (about 1-2 minutes on a 2-core CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed rounds per workload")
    p.add_argument(
        "--mem-budget-gb",
        type=float,
        default=None,
        help="skip workloads estimated above this (default 6 on CPU, 70%% of GPU memory)",
    )
    p.add_argument("--out", default=None, help="output path prefix (default benchmarks/results/gate_<device>)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's default, i.e. all cores)")
    p.add_argument("--no-plot", action="store_true")
    return p.parse_args(argv)


@dataclass
class Settings:
    """What one run measures, from the command line and the device's defaults."""

    device: str
    dtype: torch.dtype
    shapes: list[str]
    Ts: list[int]
    ns: list[int]
    actives: list[str]
    providers: list[str]
    reps: int
    mem_budget: float  # bytes
    out_prefix: Path


def resolve_settings(args: argparse.Namespace, device: str) -> Settings:
    """Fill what the command line leaves open with the device's defaults (CPU, CUDA or --quick)."""
    on_cpu = device == "cpu"
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype or ("fp32" if on_cpu else "bf16")]
    shapes = args.shapes or ("smollm2" if on_cpu else "all")
    if args.quick:
        Ts, ns, actives = QUICK_T, QUICK_N, QUICK_ACTIVE
    elif on_cpu:
        Ts, ns, actives = CPU_T, CPU_N, CPU_ACTIVE
    else:
        Ts, ns, actives = GPU_T, GPU_N, GPU_ACTIVE
    if args.mem_budget_gb is not None:
        budget = args.mem_budget_gb * 1e9
    elif on_cpu:
        budget = 6e9
    else:
        budget = 0.7 * torch.cuda.get_device_properties(0).total_memory
    return Settings(
        device=device,
        dtype=dtype,
        shapes=[k for k in SHAPES if k != "tiny"] if shapes == "all" else [shapes],
        Ts=args.T or Ts,
        ns=args.n or ns,
        actives=args.active or actives,
        providers=args.providers or PROVIDERS,
        reps=args.reps or (10 if args.quick else 15 if on_cpu else 20),
        mem_budget=budget,
        out_prefix=Path(args.out) if args.out else DEFAULT_OUT / f"gate_{device}",
    )


def describe_environment(s: Settings, argv: list[str]) -> tuple[dict, float]:
    """The run's environment record (printed) and the memory bandwidth in GB/s."""
    on_cpu = s.device == "cpu"
    env = environment(s.device)
    bw, bw_src = measure_bandwidth(s.device)
    env.update(memory_bandwidth_gbps=round(bw, 1), memory_bandwidth_source=bw_src, dtype=str(s.dtype), argv=argv)
    print(
        f"device={s.device} ({env.get('gpu', env['cpu'])}), dtype={s.dtype}, threads={env['torch_threads']}, "
        f"bandwidth~{bw:.1f} GB/s ({bw_src})"
    )
    load = env.get("loadavg")
    if on_cpu and load and load[0] > (os.cpu_count() or 1):
        msg = (
            f"warning: load average {load[0]:.1f} on {os.cpu_count()} cores: other processes compete for the CPU, "
            f"multi-threaded timings are noisy (torch threads wait at barriers); --threads 1 is steadier"
        )
        env["warning"] = msg
        print(msg)
    if on_cpu:
        print("aloe_triton: skipped on CPU (the Triton interpreter is a correctness tool, not a timing target)")
    return env, bw


def measure_workload(s: Settings, w: Workload, bw: float, skipped: dict) -> list[dict]:
    """Time every provider on one workload: one result row per provider (printed on one line)."""
    fns = build_providers(w, s.device, s.providers, skipped)
    timed = time_cuda(fns, s.reps) if s.device == "cuda" else time_cpu(fns, s.reps)
    meta = workload_bytes(w, s.dtype)
    base = {
        "shape": w.shape,
        "d": w.d,
        "d_out": w.d_out,
        "T": w.T,
        "n": w.n,
        "active": w.active,
        "active_per_token": w.active_per_token,
        "measured_active": round(w.measured_active, 3),
        "open_edits": w.open_edits,
        "dtype": str(s.dtype).replace("torch.", ""),
        "device": s.device,
        **meta,
    }
    rows = []
    line = [f"{w.shape} T={w.T} n={w.n} active={w.active} (measured {w.measured_active:.1f}/token):"]
    for prov, (med, lo, cnt) in timed.items():
        sec = med / 1e3
        row = dict(
            base,
            provider=prov,
            median_ms=round(med, 4),
            min_ms=round(lo, 4),
            rounds=cnt,
            gbps=round(meta["floor_bytes"] / sec / 1e9, 3),
            pct_of_floor=round(100.0 * (meta["floor_bytes"] / (bw * 1e9)) / sec, 2),
            tflops=round(meta["useful_flops"] / sec / 1e12, 5),
        )
        for other, (omed, _, _) in timed.items():
            if other != prov:
                row[f"speedup_vs_{other}"] = round(omed / med, 3)
        rows.append(row)
        line.append(f"{prov}={med:.3f}ms")
    print("  ".join(line))
    return rows


def run_workloads(s: Settings, bw: float) -> tuple[list[dict], dict[str, str], list[dict]]:
    """Every (shape, n, T, active) workload within the memory budget: rows, skipped providers and workloads."""
    rows: list[dict] = []
    skipped: dict[str, str] = {}
    skipped_workloads: list[dict] = []
    for shape in s.shapes:
        for n in s.ns:
            for T in s.Ts:
                for active in s.actives:
                    need = estimate_memory(shape, T, n, s.dtype)
                    if need > s.mem_budget:
                        reason = f"needs ~{need / 1e9:.1f} GB > budget {s.mem_budget / 1e9:.1f} GB"
                        print(f"skip {shape} T={T} n={n} active={active}: {reason}")
                        skipped_workloads.append({"shape": shape, "T": T, "n": n, "active": active, "reason": reason})
                        continue
                    w = make_workload(shape, T, n, active, s.dtype, s.device)
                    rows += measure_workload(s, w, bw, skipped)
                    del w
    return rows, skipped, skipped_workloads


def main(argv=None) -> int:
    from aloe_kernels.runtime import triton_interpreting

    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("--device cuda requested but CUDA is not available")
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if device == "cpu" and triton_interpreting():
        print("note: TRITON_INTERPRET is set; the fused kernel is not timed on CPU anyway")
    settings = resolve_settings(args, device)
    settings.out_prefix.parent.mkdir(parents=True, exist_ok=True)
    env, bw = describe_environment(settings, argv)
    rows, skipped, skipped_workloads = run_workloads(settings, bw)
    try:
        env["loadavg_end"] = os.getloadavg()
    except OSError:
        pass
    summary = summarize(rows)
    for line in summary["lines"]:
        print(line)
    write_results(settings.out_prefix, rows, env, skipped, skipped_workloads, summary, plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
