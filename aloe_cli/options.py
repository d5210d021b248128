"""Command-line options shared by the commands that load a model (build, eval, demo)."""

from __future__ import annotations

import argparse
from typing import Any

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
#: ``--model``'s help wherever a command loads a model by name (what ``aloe_build.load_model`` takes)
MODEL_HELP = "'smollm2', a local transformers directory, or a .gguf file"


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype``: where the model runs and in which precision."""
    p.add_argument(
        "--device", default="auto", help="cpu, cuda or cuda:N (default auto: CUDA when present, else CPU); every stage runs there"
    )
    p.add_argument(
        "--dtype", default="auto", choices=DTYPE_CHOICES, help="model precision (default auto: bfloat16 on a GPU, float32 on CPU)"
    )


def load_model_for(args: argparse.Namespace, name: str | None = None) -> tuple[Any, Any]:
    """The model and tokenizer named by ``--model`` (or ``name``), on ``--device`` in ``--dtype``."""
    from aloe_build import load_model

    model, tokenizer = load_model(name or args.model, dtype=args.dtype, device=args.device)
    param = next(model.parameters())
    print(f"model on {param.device} in {str(param.dtype).removeprefix('torch.')}")
    return model, tokenizer


def add_config_args(p: argparse.ArgumentParser) -> None:
    """``--preset``, ``--config`` and ``--set``, with every setting listed in the command's ``--help``."""
    from aloe_build.presets import PRESETS

    from .settings_doc import settings_text

    p.add_argument(
        "--preset",
        default="default",
        choices=list(PRESETS),
        help="named settings (docs/options.md); --config and --set apply on top",
    )
    p.add_argument("--config", help="JSON file of BuildConfig fields")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override one BuildConfig field")
    p.epilog = settings_text()
    p.formatter_class = argparse.RawDescriptionHelpFormatter


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """BuildConfig fields of ``--preset`` (where the command has it), then ``--config`` (a JSON file)
    and ``--set KEY=VALUE`` over them."""
    import json
    from pathlib import Path

    from aloe_build.config import parse_settings
    from aloe_build.presets import preset_fields

    preset = preset_fields(args.preset) if getattr(args, "preset", None) else {}
    overrides = json.loads(Path(args.config).read_text()) if getattr(args, "config", None) else {}
    return {**preset, **overrides, **parse_settings(args.set or [])}
