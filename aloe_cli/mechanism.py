"""``aloe mechanism``: the address-mechanism study (stage-1 objective vs the raw control)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def _cmd_mechanism(args: argparse.Namespace) -> int:
    from aloe_build import BuildConfig, default_layer
    from aloe_eval.mechanism import PAPER_DEV_ITEMS, mechanism_markdown, mechanism_study

    from .options import config_overrides, load_model_for

    overrides = config_overrides(args)
    cfg = BuildConfig.from_dict(overrides)
    model, tokenizer = load_model_for(args)
    layer = args.layer if args.layer is not None else default_layer(model)
    study = mechanism_study(
        model,
        tokenizer,
        args.corpus,
        layer,
        cfg,
        seeds=args.seeds,
        dev_items=args.dev_items or PAPER_DEV_ITEMS,
        protocols=args.protocol,
        states_path=args.states,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    study["config"] = overrides
    (out / "mechanism.json").write_text(json.dumps(study, indent=1))
    table = mechanism_markdown(study)
    (out / "mechanism.md").write_text(table + "\n")
    print(table)
    print(f"wrote {out / 'mechanism.json'}")
    return 0


def add_mechanism_cli(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from aloe_build.mechanism_protocol import PROTOCOLS

    from .options import MODEL_HELP, add_device_args

    p = subparsers.add_parser(
        "mechanism",
        help="score the address encoder's objective on held-out items against the raw control",
        description="Train stage-1 encoders on a CounterFact-style file's training part (one per seed) and score "
        "them on its development part with a threshold from its calibration part: scope AUC, "
        "recall, 16-way same-subject top-1 and negative FPR, learned vs an equal-dimension "
        "raw-activation control.",
    )
    p.add_argument("--model", required=True, help=MODEL_HELP)
    p.add_argument("--corpus", required=True, help="CounterFact-style file (e.g. CounterFact train)")
    p.add_argument("--out", required=True, help="directory for mechanism.json and mechanism.md")
    p.add_argument("--layer", type=int, default=None, help="edited decoder layer (default: the model family's)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 42, 99], help="training seeds (default 0 42 99)")
    p.add_argument("--dev-items", type=int, default=None, help="development items (default 632, as the paper)")
    p.add_argument(
        "--protocol",
        nargs="+",
        choices=PROTOCOLS,
        default=list(PROTOCOLS),
        help="subject: the paper's (relations shared, subjects disjoint); relation: held-out relations",
    )
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one BuildConfig field (stage 1)")
    p.add_argument(
        "--states",
        default=None,
        metavar="FILE",
        help="safetensors file of the collected states: read when it was made for the same model, layer, "
        "corpus and partitions, written otherwise (then each run with other --set values takes "
        "seconds to minutes instead of the state passes)",
    )
    add_device_args(p)
    p.set_defaults(func=_cmd_mechanism)
    return p
