"""ALOE plugin for vLLM (import name ``aloe_vllm``), registered through the
``vllm.general_plugins`` entry point."""


def register() -> None:
    """Register ALOE's edited architectures with vLLM. Safe to call many times."""
    from .registry import register_models

    register_models()
