"""Registration of the ALOE architectures with vLLM's ModelRegistry."""

from __future__ import annotations

from .format import ARCHITECTURES

_MODULE = "aloe_vllm.models"


def register_models() -> list[str]:
    """Register every ALOE architecture (lazily: ``aloe_vllm.models`` is imported on first use).

    Idempotent: an architecture already registered to the same target is left alone.
    Returns the architectures registered by this call.
    """
    from vllm import ModelRegistry

    done = []
    supported = set(ModelRegistry.get_supported_archs())
    for arch in ARCHITECTURES.values():
        if arch in supported:
            continue
        ModelRegistry.register_model(arch, f"{_MODULE}:{arch}")
        done.append(arch)
    return done
