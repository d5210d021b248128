"""``aloe append``, ``aloe remove`` and ``aloe update``: change the facts of a built operator."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .options import add_device_args, load_model_for


def _config(args: argparse.Namespace):
    """The BuildConfig of ``--config``/``--set`` over the operator's own, or None to keep the operator's."""
    from aloe_build import BuildConfig
    from aloe_build.build_state import BuildState
    from aloe_build.config import parse_settings
    from aloe_kernels import AloeOperator

    if not args.config and not args.set:
        return None
    op = AloeOperator.load(args.operator)
    fields = dict(BuildState.load(args.operator, op).config)
    if args.config:
        fields.update(json.loads(Path(args.config).read_text()))
    fields.update(parse_settings(args.set or []))
    return BuildConfig.from_dict(fields)


def _distinct(args: argparse.Namespace) -> None:
    """The result goes to a new directory: the operator being served or appended to stays intact."""
    from aloe_build import BuildError

    if Path(args.out).resolve() == Path(args.operator).resolve():
        raise BuildError("--out must differ from --operator (the input operator is kept as it is)")


def _cmd_append(args: argparse.Namespace, update: bool = False) -> int:
    from aloe_build import load_edits
    from aloe_build.append import append_edits, update_edits

    _distinct(args)
    requests = load_edits(args.edits, limit=args.limit, skip_invalid=args.skip_invalid)
    cfg = _config(args)
    model, tokenizer = load_model_for(args)
    out = Path(args.out)
    run = update_edits if update else append_edits
    op = run(model, tokenizer, args.operator, requests, cfg, out_dir=out)
    op.save(out)
    if not (out / "aloe_build_state.json").is_file():  # nothing new: the input operator, unchanged
        from aloe_build.append import load_with_state

        load_with_state(args.operator)[1].save(out, op)
    print(f"wrote {op.n} slots to {out}")
    return 0


def _cmd_remove(args: argparse.Namespace) -> int:
    from aloe_build.append import load_with_state, remove_edits, save_with_state

    _distinct(args)
    op, state = load_with_state(args.operator)
    kept, kept_state = remove_edits(op, state, args.ids)
    save_with_state(kept, kept_state, args.out)
    print(f"removed {len(args.ids)} edit id(s): {op.n} -> {kept.n} slots; wrote {args.out}")
    return 0


def _add_build_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="the model the operator was built for")
    p.add_argument("--operator", required=True, help="artifact directory of the operator to change")
    p.add_argument("--edits", required=True, help="edit requests (CounterFact, zsRE, KnowEdit or ALOE JSONL)")
    p.add_argument("--out", required=True, help="artifact directory of the result (may not be --operator)")
    p.add_argument("--limit", type=int, default=None, help="use only the first N edits")
    p.add_argument("--skip-invalid", action="store_true", help="skip records with an empty target instead of failing")
    p.add_argument("--config", help="JSON file of BuildConfig fields (default: the operator's build settings)")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one BuildConfig field")
    add_device_args(p)


def add_edit_cli(sub: argparse._SubParsersAction) -> None:
    """Register ``append``, ``remove`` and ``update`` on the ``aloe`` command's subparsers."""
    p = sub.add_parser("append", help="add edits to a built operator without rebuilding it")
    _add_build_args(p)
    p.set_defaults(func=_cmd_append)
    p = sub.add_parser("update", help="correct edits (same id or same prompt, new target): remove, then append")
    _add_build_args(p)
    p.set_defaults(func=lambda a: _cmd_append(a, update=True))
    p = sub.add_parser("remove", help="remove edits by id from a built operator")
    p.add_argument("--operator", required=True, help="artifact directory of the operator to change")
    p.add_argument("--ids", required=True, nargs="+", help="ids of the edits to remove")
    p.add_argument("--out", required=True, help="artifact directory of the result")
    p.set_defaults(func=_cmd_remove)
