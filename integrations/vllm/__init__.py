"""ALOE plugin for vLLM (import name ``aloe_vllm``), registered through the
``vllm.general_plugins`` entry point.

``register()`` adds the edited architectures (``AloeLlamaForCausalLM``,
``AloeMistralForCausalLM``, ``AloeQwen2ForCausalLM``, ``AloeQwen3ForCausalLM``)
to vLLM's model registry. vLLM calls it once per process (API server, engine
core, every worker); calling it again is a no-op.
"""

from .format import ARCHITECTURES, AloeSpec, AloeSpecError

__all__ = ["ARCHITECTURES", "AloeSpec", "AloeSpecError", "register"]


def register() -> None:
    """Register ALOE's edited architectures with vLLM. Safe to call many times."""
    from .registry import register_models

    register_models()
