"""``aloe export-vllm``: a directory vLLM serves, the base model edited by an operator.

``export_vllm(base, operator_dir, out_dir)`` writes a directory that
``vllm.LLM(model=out_dir)`` and ``python -m vllm.entrypoints.openai.api_server
--model out_dir`` serve directly (the ``aloe_vllm`` plugin, registered through
the ``vllm.general_plugins`` entry point, provides the architectures):

- every file of the base model directory is symlinked (copied only where a
  link cannot be made), except ``config.json``, which gets
  ``architectures: ["Aloe<Base>"]`` and an ``aloe`` section (layer, n, d,
  d_out, eps, gate_eps, fingerprints), and the safetensors index (rewritten
  when the base has one);
- ``aloe_operator.safetensors`` holds the operator under the vLLM parameter names
  ``model.layers.{L}.mlp.down_proj.aloe_{addresses,thresholds,temperatures,writes}``;
- ``aloe_edits.json`` keeps the per-edit metadata.

Before writing anything the operator is validated against the base model:
architecture, layer range, d and d_out, and the fingerprint of the base
``down_proj`` weight read from the safetensors files (``weight_fingerprint``).
Mismatches raise :class:`aloe_vllm.format.AloeSpecError` with a message that
names the problem. Nothing here imports vLLM or transformers; the ``smollm2``
base and the export cache location come from ``aloe_build.models`` (imported
when needed). :func:`add_cli` registers the subcommand on the ``aloe``
command's parser; ``aloe serve`` (:mod:`.serve`) exports and starts the server.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch

from aloe_kernels.errors import AloeError
from aloe_kernels.operator import AloeOperator, weight_fingerprint
from aloe_kernels.write_positions import DEFAULT_WRITE_POSITIONS, add_write_positions_argument, check_write_positions

from .format import (
    ARCHITECTURES,
    BASE_ARCHITECTURES,
    CONFIG_KEY,
    EDITS_FILE,
    SAFE_INDEX,
    TENSORS_FILE,
    AloeSpec,
    AloeSpecError,
    down_proj_prefix,
    tensor_names,
)

__all__ = ["ExportExistsError", "add_cli", "export_vllm", "resolve_base"]


class ExportExistsError(AloeError, FileExistsError):
    """The output directory exists (and may not be replaced)."""


_OWN_FILES = {"config.json", SAFE_INDEX, TENSORS_FILE, EDITS_FILE}


# --------------------------------------------------------------------------- base model


def resolve_base(base: str | os.PathLike) -> Path:
    """A local Hugging Face model directory for ``base``.

    ``base`` is a directory, or ``"smollm2"`` (and its aliases), which resolves
    to the cached safetensors conversion (created on first use by
    ``aloe_build.models.load_model``).
    """
    path = Path(base).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")
        return path.resolve()
    from aloe_build import models

    if str(base).lower() in models._SMOLLM2_ALIASES:
        cache = models.smollm2_cache_dir()
        if not (cache / "config.json").is_file() or not any(cache.glob("*.safetensors")):
            models.load_model("smollm2")  # converts the GGUF once and caches it
        return cache.resolve()
    raise FileNotFoundError(f"base model {str(base)!r}: not a local model directory (and not 'smollm2'); nothing is downloaded")


def _read_config(base: Path) -> dict[str, Any]:
    try:
        config = json.loads((base / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise AloeSpecError(f"{base / 'config.json'}: not readable JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise AloeSpecError(f"{base / 'config.json'}: expected a JSON object")
    return config


def _base_architecture(config: dict[str, Any], source: Path) -> str:
    archs = config.get("architectures") or []
    if CONFIG_KEY in config or any(a in BASE_ARCHITECTURES for a in archs):
        raise AloeSpecError(f"{source}: this is already an ALOE serving directory; export from the original base model")
    for arch in archs:
        if arch in ARCHITECTURES:
            return arch
    raise AloeSpecError(
        f"{source}: architectures={archs} is not supported by the vLLM integration "
        f"(supported: {', '.join(sorted(ARCHITECTURES))})"
    )


def _text_dims(config: dict[str, Any]) -> tuple[int, int, int]:
    cfg = config.get("text_config") or config
    try:
        return int(cfg["num_hidden_layers"]), int(cfg["intermediate_size"]), int(cfg["hidden_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise AloeSpecError(f"config.json lacks num_hidden_layers/intermediate_size/hidden_size ({exc})") from exc


def _weight_files(base: Path) -> tuple[list[Path], dict[str, str] | None]:
    """Safetensors files of the base, and its index's weight map if it has one."""
    index = base / SAFE_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({base / f for f in weight_map.values()}), weight_map
    files = sorted(p for p in base.glob("*.safetensors") if p.name != TENSORS_FILE)
    if not files:
        raise AloeSpecError(
            f"{base}: no *.safetensors weights; the vLLM export needs a safetensors checkpoint "
            "(convert the model with save_pretrained(safe_serialization=True))"
        )
    return files, None


def read_base_weight(base: Path, name: str) -> torch.Tensor:
    """One tensor of the base checkpoint, read from its safetensors file(s)."""
    from safetensors import safe_open

    files, weight_map = _weight_files(base)
    if weight_map is not None:
        files = [base / weight_map[name]] if name in weight_map else []
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            if name in fh.keys():
                return fh.get_tensor(name)
    raise AloeSpecError(f"{base}: the checkpoint has no tensor {name!r}")


# --------------------------------------------------------------------------- export


def validate_for_base(op: AloeOperator, base: Path, layer: int | None = None) -> tuple[AloeSpec, str]:
    """Check ``op`` against the base model; returns the spec to write and the base architecture."""
    config = _read_config(base)
    arch = _base_architecture(config, base / "config.json")
    num_layers, d, d_out = _text_dims(config)
    if layer is None:
        layer = op.layer
    if layer is None:
        raise AloeSpecError("the operator does not record its layer; pass --layer")
    if op.layer is not None and layer != op.layer:
        raise AloeSpecError(f"the operator was built for layer {op.layer}, not layer {layer}")
    fp_base = weight_fingerprint(read_base_weight(base, down_proj_prefix(layer) + ".weight")) if 0 <= layer < num_layers else None
    spec = AloeSpec(
        layer=int(layer),
        n=op.n,
        d=op.d,
        d_out=op.d_out,
        eps=float(op.eps),
        gate_eps=float(op.gate_eps),
        dtype="float32" if op.dtype == torch.float64 else str(op.dtype).replace("torch.", ""),
        weight_fingerprint=fp_base,
        base_model=op.base_model or config.get("_name_or_path") or base.name,
        base_architecture=arch,
        operator_fingerprint=op.fingerprint(),
        reading_decay=float(op.reading_decay),
    )
    spec.check_model(num_layers=num_layers, d=d, d_out=d_out, source=f"operator vs {base}")
    if op.weight_fingerprint and op.weight_fingerprint != fp_base:
        raise AloeSpecError(
            f"weight fingerprint mismatch: the operator was built for a down_proj weight with fingerprint "
            f"{op.weight_fingerprint} ({op.base_model or 'unknown base'}), but {base} layer {layer} has "
            f"{fp_base}: wrong base model or layer"
        )
    if not op.weight_fingerprint:
        warnings.warn(
            "the operator records no weight fingerprint; the export binds it to the base weight it was "
            "exported with, but could not check that it was built for it",
            stacklevel=3,
        )
    return spec, arch


def _link_or_copy(src: Path, dst: Path, link: bool) -> None:
    if link:
        try:
            os.symlink(src, dst, target_is_directory=src.is_dir())
            return
        except OSError:
            pass
    if src.is_dir():
        shutil.copytree(src, dst, symlinks=True)
    else:
        shutil.copy2(src, dst)


def _is_export(path: Path) -> bool:
    try:
        return CONFIG_KEY in json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False


def export_vllm(
    base: str | os.PathLike,
    operator_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    layer: int | None = None,
    overwrite: bool = False,
    link: bool = True,
    capacity: int | None = None,
    write_positions: str = DEFAULT_WRITE_POSITIONS,
) -> Path:
    """Write a vLLM serving directory for ``base`` edited by the operator at ``operator_dir``.

    Validates first (see the module docstring) and writes atomically (a
    temporary directory renamed into place). ``overwrite`` replaces an existing
    export (only a directory that is itself an ALOE export, or an empty one).
    ``capacity`` (>= the operator's n) reserves that many edit slots for live
    swaps (``aloe.capacity`` in config.json). ``write_positions`` (``aloe.write_positions``): where
    the residual is kept (:mod:`aloe_kernels.write_positions`). Returns the output directory.
    """
    base_dir = resolve_base(base)
    op = AloeOperator.load(operator_dir)
    spec, arch = validate_for_base(op, base_dir, layer)
    if capacity is not None:
        if capacity < op.n:
            raise AloeSpecError(f"capacity {capacity} (--max-edits) is below the operator's {op.n} edits")
        spec = dataclasses.replace(spec, capacity=int(capacity))
    spec = dataclasses.replace(spec, write_positions=check_write_positions(write_positions))
    out = Path(out_dir).expanduser().absolute()
    if out.exists():
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        elif overwrite and out.is_dir() and _is_export(out):
            pass
        else:
            raise ExportExistsError(
                f"{out} exists"
                + (
                    " (pass overwrite=True / --overwrite to replace an export)"
                    if _is_export(out)
                    else " and is not an ALOE export; refusing to touch it"
                )
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_export(tmp, base_dir, op, spec, arch, link)
        if out.exists():
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_export(out: Path, base: Path, op: AloeOperator, spec: AloeSpec, arch: str, link: bool) -> None:
    from safetensors.torch import save_file

    for entry in sorted(base.iterdir()):
        if entry.name in _OWN_FILES or entry.name.startswith("."):
            continue
        _link_or_copy(entry, out / entry.name, link)
    config = _read_config(base)
    config["architectures"] = [ARCHITECTURES[arch]]
    config[CONFIG_KEY] = spec.to_json()
    (out / "config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")

    dtype = torch.float32 if op.dtype == torch.float64 else op.dtype
    names = tensor_names(spec.layer)
    tensors = {
        names[k]: getattr(op, k).detach().to("cpu", dtype).contiguous()
        for k in ("addresses", "thresholds", "temperatures", "writes")
    }
    save_file(tensors, str(out / TENSORS_FILE), metadata={"format": "pt", "aloe_spec": json.dumps(spec.to_json())})

    index = base / SAFE_INDEX
    if index.is_file():
        data = json.loads(index.read_text())
        data.setdefault("weight_map", {}).update({name: TENSORS_FILE for name in tensors})
        (out / SAFE_INDEX).write_text(json.dumps(data, indent=2) + "\n")

    meta = {
        "operator": {
            "base_model": op.base_model,
            "layer": op.layer,
            "module_path": op.module_path,
            "weight_fingerprint": op.weight_fingerprint,
            "operator_fingerprint": spec.operator_fingerprint,
            "n": op.n,
            "dtype": str(op.dtype).replace("torch.", ""),
        },
        "base_dir": str(base),
        "edits": op.edits,
    }
    (out / EDITS_FILE).write_text(json.dumps(meta, indent=1, ensure_ascii=False) + "\n")


def _cmd_export(args: argparse.Namespace) -> int:
    out = export_vllm(
        args.model,
        args.operator,
        args.out,
        layer=args.layer,
        overwrite=args.overwrite,
        link=not args.copy,
        capacity=args.max_edits,
        write_positions=args.write_positions,
    )
    print(out)
    return 0


def add_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register ``export-vllm`` on the ``aloe`` command's subparsers."""
    p = subparsers.add_parser("export-vllm", help="write a directory vLLM serves: base model (linked) + operator")
    p.add_argument("--model", required=True, help="base model directory (or 'smollm2')")
    p.add_argument("--operator", required=True, help="ALOE operator artifact directory")
    p.add_argument("--out", required=True, help="serving directory to create")
    p.add_argument("--layer", type=int, default=None, help="edited layer (default: the operator's)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export")
    p.add_argument("--copy", action="store_true", help="copy the base files instead of symlinking them")
    p.add_argument("--max-edits", type=int, default=None, help="edit slots to reserve for live swaps (default: the operator's n)")
    add_write_positions_argument(p)
    p.set_defaults(func=_cmd_export)
