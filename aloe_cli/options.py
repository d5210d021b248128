"""Command-line options shared by the commands that load a model (build, eval, demo)."""

from __future__ import annotations

import argparse
from typing import Any

DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def add_device_args(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype``: where the model runs and in which precision."""
    p.add_argument("--device", default="auto",
                   help="cpu, cuda or cuda:N (default auto: CUDA when present, else CPU); every stage runs there")
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="model precision (default auto: bfloat16 on a GPU, float32 on CPU)")


def load_model_for(args: argparse.Namespace, name: str | None = None) -> tuple[Any, Any]:
    """The model and tokenizer named by ``--model`` (or ``name``), on ``--device`` in ``--dtype``."""
    from aloe_build import load_model

    model, tokenizer = load_model(name or args.model, dtype=args.dtype, device=args.device)
    param = next(model.parameters())
    print(f"model on {param.device} in {str(param.dtype).removeprefix('torch.')}")
    return model, tokenizer


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """BuildConfig fields from ``--config`` (a JSON file, where the command has it) and ``--set KEY=VALUE``."""
    import json
    from pathlib import Path

    from aloe_build.config import parse_settings

    overrides = json.loads(Path(args.config).read_text()) if getattr(args, "config", None) else {}
    return {**overrides, **parse_settings(args.set or [])}
