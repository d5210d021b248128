"""The tensor-parallel ALOE layer's extra all-reduce, measured on CPU (gloo, two processes).

With TP > 1 every forward of the edited layer all-reduces the (T, capacity + 1) fp32 partial
scores before the gates (``aloe_vllm.layer``), besides the layer's own output all-reduce of
(T, d_out) in the model dtype. This prints both buffers' sizes and median times for a few token
counts, so the scores' share of the layer's communication is seen beside the all-reduce every
row-parallel layer already does.

    python -m experiments.tp_allreduce --capacity 10000 --d-out 4096 --out benchmarks/results/tp_allreduce_cpu
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _time_all_reduce(shape: tuple[int, ...], dtype: torch.dtype, reps: int) -> float:
    """Median seconds of one all-reduce (sum) of a tensor of ``shape`` over the group."""
    buf = torch.ones(shape, dtype=dtype)
    for _ in range(3):  # warm-up
        dist.all_reduce(buf)
    times = []
    for _ in range(reps):
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rows = []
    for T in args.tokens:
        scores = _time_all_reduce((T, args.capacity + 1), torch.float32, args.reps)
        output = _time_all_reduce((T, args.d_out), torch.bfloat16, args.reps)
        rows.append(
            {
                "tokens": T,
                "scores_mb": T * (args.capacity + 1) * 4 / 1e6,
                "scores_ms": scores * 1e3,
                "output_mb": T * args.d_out * 2 / 1e6,
                "output_ms": output * 1e3,
            }
        )
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--capacity", type=int, default=10000, help="edit slots the served layer reserves")
    p.add_argument("--d-out", type=int, default=4096, help="the layer's output width (Llama-3-8B: 4096)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 32, 512])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--out", default=None, help="write <out>.json and <out>.md")
    args = p.parse_args(argv)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = Path(args.out + ".tmp.json" if args.out else f"/tmp/tp_allreduce_{os.getpid()}.json")
    mp.spawn(_worker, args=(args.tp, port, args, str(tmp)), nprocs=args.tp, join=True)
    rows = json.loads(tmp.read_text())
    tmp.unlink()
    lines = [
        f"TP={args.tp} on CPU (gloo), capacity {args.capacity}, d_out {args.d_out}; median of {args.reps}",
        "",
        "| tokens | scores (T, c+1) fp32 | time | layer output (T, d_out) bf16 | time | scores / output time |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['tokens']} | {r['scores_mb']:.2f} MB | {r['scores_ms']:.3f} ms | {r['output_mb']:.3f} MB | "
            f"{r['output_ms']:.3f} ms | {r['scores_ms'] / r['output_ms']:.1f}x |"
        )
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out + ".json").write_text(
            json.dumps({"settings": vars(args), "torch": torch.__version__, "rows": rows}, indent=1)
        )
        Path(args.out + ".md").write_text(
            report + f"\n\nCommand: `python -m experiments.tp_allreduce --capacity {args.capacity} --d-out {args.d_out}"
            f" --tp {args.tp} --out {args.out}`\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
