"""The ``aloe`` command line: the one module that sees every package."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence


def _cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    from aloe_kernels import AloeOperator

    op = AloeOperator.load(args.operator)
    norms = op.addresses.float().norm(dim=1) if op.n else torch.zeros(0)
    summary = {
        "path": str(args.operator),
        "n": op.n,
        "d": op.d,
        "d_out": op.d_out,
        "dtype": str(op.dtype).replace("torch.", ""),
        "layer": op.layer,
        "module_path": op.module_path,
        "base_model": op.base_model,
        "weight_fingerprint": op.weight_fingerprint,
        "operator_hash": op.fingerprint(),
        "eps": op.eps,
        "gate_eps": op.gate_eps,
        # what the gates read: 0 the current token's state, else a running mean (aloe_kernels.reading)
        "reading_decay": op.reading_decay,
        "address_norm": _stats(norms),
        "threshold": _stats(op.thresholds.float()),
        "temperature": _stats(op.temperatures.float()),
        "write_norm": _stats(op.writes.float().norm(dim=1) if op.n else torch.zeros(0)),
        "bytes": sum(t.numel() * t.element_size() for t in (op.addresses, op.thresholds, op.temperatures, op.writes)),
    }
    if args.edits:
        summary["edits"] = op.edits[: args.edits]
    print(json.dumps(summary, indent=2, ensure_ascii=False))
    return 0


def _stats(t) -> dict[str, float] | None:
    if t.numel() == 0:
        return None
    return {"min": float(t.min()), "median": float(t.median()), "max": float(t.max())}


def _cmd_build(args: argparse.Namespace) -> int:
    from pathlib import Path

    from aloe_build import BuildConfig, build_operator, distributed, load_edits

    from .options import config_overrides, load_model_for

    if args.procs > 1 and distributed.launched_ranks() == 1:
        from .launch import launch

        return launch(args.argv, args.procs)
    overrides = config_overrides(args)
    if args.layer is not None:
        overrides["layer"] = args.layer
    cfg = BuildConfig.from_dict(overrides)
    requests = load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid)
    if distributed.launched_ranks() > 1 and args.device in ("auto", "cuda"):
        import torch

        if torch.cuda.is_available():  # one GPU per process of this machine
            args.device = f"cuda:{distributed.local_rank()}"
            torch.cuda.set_device(distributed.local_rank())
    model, tokenizer = load_model_for(args)
    distributed.init_from_launcher(next(model.parameters()).device)
    finished = False
    try:
        out = Path(args.out)
        op = build_operator(model, tokenizer, requests, cfg, out_dir=out)
        if distributed.is_main():
            op.save(out)
            ranks = f" by {distributed.world_size()} processes" if distributed.active() else ""
            print(f"wrote {len(requests)} edits ({op.n} slots) to {out}{ranks} (report: {out / 'build_report.json'})")
        finished = True
    finally:
        distributed.shutdown(finished)
    if distributed.launched_ranks() > 1:
        distributed.end_process(0)
    return 0


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    from .options import MODEL_HELP, add_config_args, add_device_args

    parser = argparse.ArgumentParser(prog="aloe", description="Edit facts in a language model with ALOE operators.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarise an operator artifact")
    p.add_argument("operator", help="artifact directory")
    p.add_argument("--edits", type=int, default=0, help="also print the metadata of the first N edits")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("build", help="build an operator for a file of edit requests")
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--edits", required=True, help="edit requests (CounterFact, zsRE, KnowEdit or ALOE JSONL)")
    p.add_argument("--out", required=True, help="artifact directory (also holds checkpoints and build_report.json)")
    p.add_argument("--layer", type=int, default=None, help="edited decoder layer (default: the model family's)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N edits")
    p.add_argument("--skip-invalid", action="store_true", help="skip records with an empty target instead of failing")
    p.add_argument(
        "--procs",
        type=_at_least_one,
        default=1,
        help="build with N processes (torch.distributed: gloo on CPU, NCCL with one GPU each); docs/options.md",
    )
    add_config_args(p)
    add_device_args(p)
    p.set_defaults(func=_cmd_build)

    from aloe_vllm.export import add_cli as add_export_cli
    from aloe_vllm.serve import add_serve_cli

    from .demo import add_demo_cli
    from .edits import add_edit_cli
    from .eval import add_eval_cli
    from .mechanism import add_mechanism_cli

    add_edit_cli(sub)
    add_demo_cli(sub)
    add_eval_cli(sub)
    add_mechanism_cli(sub)
    add_export_cli(sub)
    add_serve_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``aloe`` console script."""
    from .memory import keep_freed_memory

    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # what `aloe build --procs` runs again
    keep_freed_memory()
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a clear one-line message rather than a traceback for expected errors
        from aloe_build import BuildError, EditDataError
        from aloe_build.build_state import BuildStateError
        from aloe_build.models import ModelLoadError
        from aloe_kernels.errors import AloeError

        if isinstance(exc, (AloeError, FileNotFoundError, EditDataError, BuildError, ModelLoadError, BuildStateError)):
            print(f"aloe {args.command}: error: {exc}", file=sys.stderr)
            return 2
        raise
