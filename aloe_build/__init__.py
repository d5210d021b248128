"""ALOE construction: edit requests, model loading and the build pipeline (stages 1-8)."""

from .config import BuildConfig
from .data import EditDataError, EditRequest, LocalityPrompt, PortabilityPrompt, load_edits, save_edits_jsonl
from .models import default_layer, load_model
from .pipeline import BuildError, build_operator

__all__ = [
    "BuildConfig",
    "BuildError",
    "EditDataError",
    "EditRequest",
    "LocalityPrompt",
    "PortabilityPrompt",
    "build_operator",
    "default_layer",
    "load_edits",
    "load_model",
    "save_edits_jsonl",
]
