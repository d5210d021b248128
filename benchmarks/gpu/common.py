"""What every part of the GPU suite shares: the run context, the environment record,
target verdicts, result files and imports from the source tree (nothing installed)."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
SCRATCH = ROOT / "scratch"  # untracked, not ignored: travels to the GPU machine with the working tree
RESULTS = ROOT / "benchmarks" / "results" / "gpu"


def source_tree_imports() -> None:
    """Make the packages importable from the checkout, as an install would.

    ``aloe_vllm`` lives in ``integrations/vllm`` (a package-dir mapping of the
    install); putting ``integrations`` on sys.path would shadow the real vllm,
    so the package is registered under its own name instead.
    """
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if "aloe_vllm" not in sys.modules and importlib.util.find_spec("aloe_vllm") is None:
        pkg = ROOT / "integrations" / "vllm"
        spec = importlib.util.spec_from_file_location("aloe_vllm", pkg / "__init__.py", submodule_search_locations=[str(pkg)])
        if spec is not None and spec.loader is not None:
            module = importlib.util.module_from_spec(spec)
            sys.modules["aloe_vllm"] = module
            spec.loader.exec_module(module)


@dataclass
class Context:
    """One suite run: where results go and whether it is the CPU smoke run."""

    out: Path
    smoke: bool
    device: str  # "cuda" or "cpu"
    env: dict = field(default_factory=dict)

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


@dataclass
class PartResult:
    """What a part reports: its status, summary line, targets and where its output went."""

    part: str
    status: str = "ok"  # ok | miss | fail | skipped | crashed
    lines: list[str] = field(default_factory=list)
    targets: list[dict] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def log(self, line: str) -> None:
        """Print a line now (GPU calls are long: progress must show) and keep it for the text file."""
        print(f"  [{self.part}] {line}", flush=True)
        self.lines.append(line)

    def target(self, name: str, value: float | None, op: str, threshold: float, unit: str = "") -> bool | None:
        """Record one target of the issue: PASS/MISS from a measured value, n/a when nothing was measured."""
        if value is None or value != value:  # None or NaN: no figure, no verdict
            verdict = "n/a"
        else:
            ok = value >= threshold if op == ">=" else value <= threshold
            verdict = "PASS" if ok else "MISS"
        shown = "not measured" if verdict == "n/a" else f"{value:.3g}{unit}"
        self.targets.append({"target": name, "value": value, "op": op, "threshold": threshold, "verdict": verdict})
        self.log(f"{verdict} {name}: {shown} (target {op} {threshold:g}{unit})")
        return None if verdict == "n/a" else verdict == "PASS"

    def summary(self) -> str:
        """One line: status, target verdict counts and the first few verdicts with their numbers."""
        counts = {v: sum(t["verdict"] == v for t in self.targets) for v in ("PASS", "MISS", "n/a")}
        head = f"{self.part}: {self.status.upper()} ({self.seconds:.0f} s)"
        if self.targets:
            head += f"; targets PASS {counts['PASS']} MISS {counts['MISS']} n/a {counts['n/a']}"
        note = self.data.get("summary")
        return f"{head}; {note}" if note else head


def slug(name: str) -> str:
    """A folder name from a device name: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def environment(device: str) -> dict[str, Any]:
    """Device name and versions of torch, Triton, transformers and CUDA, with a timestamp."""
    from benchmarks.gate.bench_gate import environment as base_environment

    env = base_environment(device)
    try:
        import transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    env["device_name"] = env.get("gpu") or f"cpu ({env['cpu']})"
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        env.update(
            gpu_memory_gb=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            cudnn=torch.backends.cudnn.version(),
        )
    env["timestamp_utc"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return env


def default_out(device: str) -> Path:
    """``benchmarks/results/gpu/<device-slug>/``; the CPU smoke run writes to a temporary folder (not results).

    When ``$OUT`` is set (the device machine's folder of files that come back), the
    same relative path is used under it, so the returned tree mirrors the repository.
    """
    import os

    if device == "cuda":
        base = Path(os.environ["OUT"]) / RESULTS.relative_to(ROOT) if os.environ.get("OUT") else RESULTS
        return base / slug(torch.cuda.get_device_name())
    import tempfile

    return Path(tempfile.gettempdir()) / "aloe_gpu_suite_smoke"


def write_part(ctx: Context, res: PartResult) -> Path:
    """``<part>.json`` (environment, targets, data) and ``<part>.txt`` (the printed lines)."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    payload = {
        "part": res.part,
        "status": res.status,
        "seconds": round(res.seconds, 1),
        "smoke": ctx.smoke,
        "environment": ctx.env,
        "targets": res.targets,
        "data": res.data,
    }
    path = ctx.out / f"{res.part}.json"
    path.write_text(json.dumps(payload, indent=1, default=str))
    header = (
        f"# {res.part} on {ctx.env.get('device_name')}; torch {ctx.env.get('torch')}, triton "
        f"{ctx.env.get('triton')}, transformers {ctx.env.get('transformers')}, CUDA {ctx.env.get('cuda')}; "
        f"{ctx.env.get('timestamp_utc')}{' (smoke)' if ctx.smoke else ''}\n"
    )
    (ctx.out / f"{res.part}.txt").write_text(header + "\n".join(res.lines) + "\n" + res.summary() + "\n")
    res.files += [str(path), str(ctx.out / f"{res.part}.txt")]
    return path


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|, in float64."""
    ref = ref.double()
    return float((got.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def float64_delta(h, op):
    """U g(h) in float64 from the operator's own (rounded) tensors: the reference every check uses."""
    from aloe_kernels import aloe_reference

    return aloe_reference(h.double(), op.to(dtype=torch.float64))


def run_process(cmd: list[str], env: dict, timeout: float) -> tuple[int, str, float]:
    """Run ``cmd`` in the repository root: return code (124 on timeout), stdout+stderr and seconds."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        rc, text = 124, out + f"\n(timed out after {timeout:.0f} s)"
    return rc, text, time.perf_counter() - t0
