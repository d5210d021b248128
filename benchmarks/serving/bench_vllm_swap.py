"""Live edits on vLLM's OpenAI server (CPU): swap latency and throughput under swaps.

One server (``aloe serve``'s command: ``--max-edits`` slots, the admin
middleware and worker extension) serves SmolLM2 with an operator ``old`` of
``--edits`` random calibrated edits (``benchmarks.serving.vllm_inputs``); ``new`` is
``old`` plus one fact edit that makes a probe prompt answer a new target
(checked on the patched transformers model before serving).

- Swap latency: with ``old`` live, ``POST /v1/aloe/operator`` {new} is sent
  while a client sends one-token completions of the probe prompt back to back;
  the latency is the time from sending the POST to receiving the first
  completion that shows the new target. Repeated ``--swaps`` times (swapping
  back to ``old`` in between, untimed).
- Throughput: ``--clients`` clients send completions (``--max-tokens`` tokens,
  ``ignore_eos``) for ``--phase-s`` seconds; phases without swaps and with a
  swap (old <-> new) every ``--swap-every-s`` seconds alternate for
  ``--rounds`` rounds. Ratio = median tokens/s with swaps / without.

Results: ``<out>.json`` (settings, versions, every sample) and ``<out>.md`` (summary).

    python -m benchmarks.serving.bench_vllm_swap --out benchmarks/results/vllm_swap_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.serving.bench_vllm import PROMPTS, _calibration_texts, _cpu, _states, _versions

PROBE = ("The Eiffel Tower is located in the city of", "Rome")
KEY = "bench-admin-key-0123456789"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--layer", type=int, default=14)
    p.add_argument("--capacity", type=int, default=10000, help="--max-edits: slots the server reserves")
    p.add_argument("--edits", type=int, default=9999, help="edits of the old operator (new = old + 1)")
    p.add_argument("--swaps", type=int, default=5, help="timed swaps for the latency")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--phase-s", type=float, default=30.0)
    p.add_argument("--swap-every-s", type=float, default=5.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", default="benchmarks/results/vllm_swap_cpu")
    return p.parse_args(argv)


def build_operators(args: argparse.Namespace, work: Path) -> Path:
    """Save ``old`` and ``new`` under ``work``; returns the base model directory."""
    import torch

    from aloe_build.models import load_model
    from aloe_kernels import AloeOperator, apply_aloe, remove_aloe, weight_fingerprint
    from aloe_kernels.hf import locate_down_proj
    from aloe_vllm.export import resolve_base
    from benchmarks.serving.vllm_inputs import random_sparse_operator

    base_dir = resolve_base(args.model)
    model, tok = load_model(str(base_dir))
    site = locate_down_proj(model, args.layer)
    fp = weight_fingerprint(site.weight())
    old = random_sparse_operator(
        args.edits,
        site.d,
        site.d_out,
        states=_states(model, tok, _calibration_texts()[0], args.layer),
        write_scale=0.05,
        seed=1,
        layer=args.layer,
        weight_fingerprint=fp,
    )
    # The fact: opens on the probe's last token, writes along the target's unembedding row
    # (scaled up until the patched model answers the target).
    h = _states(model, tok, [PROBE[0]], args.layer)[-1:]
    target = tok(" " + PROBE[1], add_special_tokens=False).input_ids[0]
    direction = torch.nn.functional.normalize(model.get_output_embeddings().weight[target].detach().float(), dim=0)
    ids = tok(PROBE[0], return_tensors="pt").input_ids
    for scale in (160.0, 320.0, 640.0, 1280.0):
        fact = AloeOperator(
            addresses=torch.nn.functional.normalize(h, dim=1),
            thresholds=torch.tensor([0.9]),
            temperatures=torch.tensor([40.0]),
            writes=scale * direction[None],
            layer=args.layer,
            weight_fingerprint=fp,
            edits=[{"id": "fact"}],
        )
        new = old.append(fact)
        apply_aloe(model, new)
        with torch.no_grad():
            first = int(model(input_ids=ids).logits[0, -1].argmax())
        remove_aloe(model)
        if first == target:
            break
    else:
        raise RuntimeError("no write scale makes the probe answer the target")
    old.save(work / "old")
    new.save(work / "new")
    return base_dir


def _post(url: str, body: dict, key: str | None = None, timeout: float = 300) -> dict:
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


class Server:
    """The OpenAI server on an export of ``old`` with ``capacity`` slots and the live-edit extension points."""

    def __init__(self, args: argparse.Namespace, base_dir: Path, work: Path):
        import subprocess

        from aloe_vllm.export import export_vllm
        from aloe_vllm.serve import serve_command

        self.work = work
        model = export_vllm(base_dir, work / "old", work / "serve", overwrite=True, capacity=args.capacity)
        port = 8000 + os.getpid() % 1000
        self.url, self.model = f"http://127.0.0.1:{port}", str(model)
        cmd = serve_command(model, "127.0.0.1", port, ["--dtype", "float32", "--max-model-len", "512"], live_edits=True)
        env = {**os.environ, "ALOE_ADMIN_KEY": KEY, "ALOE_ADMIN_ROOT": str(self.work), "VLLM_CPU_KVCACHE_SPACE": "2"}
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        self.log = (work / "server.log").open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 900) -> None:
        import urllib.request

        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited; see {self.work / 'server.log'}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        raise RuntimeError("server not ready")

    def swap(self, name: str) -> dict:
        return _post(self.url + "/v1/aloe/operator", {"path": str(self.work / name)}, KEY)

    def complete(self, prompt: str, max_tokens: int, ignore_eos: bool = False) -> dict:
        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": ignore_eos,
            "return_token_ids": True,
        }
        return _post(self.url + "/v1/completions", body)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)


def swap_latency(server: Server, target_text: str, swaps: int) -> list[float]:
    """Seconds from sending the POST {new} to the first probe completion that shows the new target."""
    out = []
    for _ in range(swaps):
        server.swap("old")
        assert target_text not in server.complete(PROBE[0], 1)["choices"][0]["text"]
        t0 = time.perf_counter()
        poster = threading.Thread(target=server.swap, args=("new",))
        poster.start()
        while target_text not in server.complete(PROBE[0], 1)["choices"][0]["text"]:
            pass
        out.append(time.perf_counter() - t0)
        poster.join()
    return out


def throughput(server: Server, args: argparse.Namespace, with_swaps: bool) -> float:
    """Generated tokens/s of ``--clients`` closed-loop clients over one phase."""
    stop = time.perf_counter() + args.phase_s
    tokens = [0] * args.clients

    def client(i: int) -> None:
        k = 0
        while time.perf_counter() < stop:
            out = server.complete(PROMPTS[(i + k) % len(PROMPTS)], args.max_tokens, ignore_eos=True)
            tokens[i] += out["usage"]["completion_tokens"]
            k += 1

    t0 = time.perf_counter()
    with ThreadPoolExecutor(args.clients) as pool:
        futures = [pool.submit(client, i) for i in range(args.clients)]
        names = ["new", "old"]
        while with_swaps and time.perf_counter() + args.swap_every_s < stop:
            time.sleep(args.swap_every_s)
            server.swap(names[0])
            names.reverse()
        for f in futures:
            f.result()
    return sum(tokens) / (time.perf_counter() - t0)


def _load(values) -> str:
    return "/".join(f"{v:.1f}" for v in values) if values else "?"


def write_summary(out: Path, meta: dict) -> None:
    """``<out>.md``: the two measures against their targets, and how they were taken."""
    lat, tp = meta["latency_s"], meta["throughput"]
    ratio = meta["throughput_ratio"]
    lines = [
        "# Live operator swaps on vLLM's OpenAI server (CPU)",
        "",
        f"Command: `{meta['command']}`",
        "",
        f"SmolLM2-135M-Instruct, fp32, layer {meta['settings']['layer']}, capacity {meta['settings']['capacity']} "
        f"slots, old operator {meta['settings']['edits']} edits, new = old + 1 fact; "
        f"{meta['cpu'].get('model', '?')}, {meta['cpu']['cores']} cores (load average at start "
        f"{_load(meta['cpu'].get('loadavg_start'))}); vllm-cpu {meta['versions'].get('vllm-cpu', '?')}.",
        "",
        "| measure | result | target |",
        "|---|---|---|",
        f"| POST to first completion showing the new fact (median of {len(lat)}) | {statistics.median(lat):.2f} s "
        f"(max {max(lat):.2f} s) | <= 2 s |",
        f"| throughput with a swap every {meta['settings']['swap_every_s']:.0f} s / without (median of "
        f"{len(tp['swaps'])} phases each) | {100 * ratio:.1f}% ({statistics.median(tp['swaps']):.1f} vs "
        f"{statistics.median(tp['none']):.1f} tok/s) | >= 95% |",
        "",
        f"Throughput: {meta['settings']['clients']} closed-loop clients, {meta['settings']['max_tokens']} tokens "
        f"each (ignore_eos), {meta['settings']['phase_s']:.0f} s phases alternating without/with swaps; "
        f"phases ranged {min(tp['none']):.1f}-{max(tp['none']):.1f} tok/s without swaps and "
        f"{min(tp['swaps']):.1f}-{max(tp['swaps']):.1f} with (a shared machine: load average at the end "
        f"{_load(meta.get('loadavg_end'))}), so the ratio is known to a few percent. The operator is loaded and "
        f"hashed in a background thread of the worker while the engine keeps stepping; the copy into the "
        f"slots happens between two steps. Samples in `{out.with_suffix('.json').name}`.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    args = parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="aloe-bench-swap-"))
    work.mkdir(parents=True, exist_ok=True)
    meta = {
        "benchmark": "vllm live operator swaps",
        "command": "python -m benchmarks.serving.bench_vllm_swap " + " ".join(argv if argv is not None else sys.argv[1:]),
        "versions": _versions(),
        "cpu": _cpu(),
        "settings": {k: v for k, v in vars(args).items() if k not in ("workdir", "out")},
    }
    base_dir = build_operators(args, work)
    server = Server(args, base_dir, work)
    try:
        server.wait_ready()
        meta["latency_s"] = [round(x, 3) for x in swap_latency(server, PROBE[1], args.swaps)]
        print("swap latency (s):", meta["latency_s"], flush=True)
        tp = {"none": [], "swaps": []}
        for r in range(args.rounds):
            for mode in ("none", "swaps") if r % 2 == 0 else ("swaps", "none"):
                tp[mode].append(round(throughput(server, args, mode == "swaps"), 2))
                print(f"round {r} {mode}: {tp[mode][-1]} tok/s", flush=True)
        meta["throughput"] = tp
        meta["throughput_ratio"] = round(statistics.median(tp["swaps"]) / statistics.median(tp["none"]), 4)
        meta["loadavg_end"] = os.getloadavg()
    finally:
        server.stop()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")
    write_summary(out, meta)
    print(out.with_suffix(".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
