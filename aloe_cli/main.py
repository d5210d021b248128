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

    from aloe_build import BuildConfig, build_operator, load_edits

    from .options import config_overrides, load_model_for

    overrides = config_overrides(args)
    if args.layer is not None:
        overrides["layer"] = args.layer
    cfg = BuildConfig.from_dict(overrides)
    requests = load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid)
    model, tokenizer = load_model_for(args)
    out = Path(args.out)
    op = build_operator(model, tokenizer, requests, cfg, out_dir=out)
    op.save(out)
    print(f"wrote {len(requests)} edits ({op.n} slots) to {out} (report: {out / 'build_report.json'})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .options import add_config_args, add_device_args

    parser = argparse.ArgumentParser(prog="aloe", description="Edit facts in a language model with ALOE operators.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("inspect", help="summarise an operator artifact")
    p.add_argument("operator", help="artifact directory")
    p.add_argument("--edits", type=int, default=0, help="also print the metadata of the first N edits")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("build", help="build an operator for a file of edit requests")
    p.add_argument("--model", required=True, help="'smollm2' or a local transformers directory")
    p.add_argument("--edits", required=True, help="edit requests (CounterFact, zsRE, KnowEdit or ALOE JSONL)")
    p.add_argument("--out", required=True, help="artifact directory (also holds checkpoints and build_report.json)")
    p.add_argument("--layer", type=int, default=None, help="edited decoder layer (default: the model family's)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N edits")
    p.add_argument("--skip-invalid", action="store_true", help="skip records with an empty target instead of failing")
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
