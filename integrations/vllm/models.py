"""Edited architectures: thin subclasses of vLLM's Llama, Mistral, Qwen2 and Qwen3
causal LMs whose edited layer's ``mlp.down_proj`` is an :class:`AloeRowParallelLinear`.

The subclass builds the base model as usual, then swaps the one down-projection
named by the ``aloe`` section of ``config.json`` for the ALOE layer (same sizes,
quantization, prefix and TP settings). Weights load through vLLM's own loader:
the operator tensors are ordinary checkpoint tensors of that module. While the
weights stream by, the base down-projection's weight is fingerprinted
(``aloe_kernels.weight_fingerprint``) and compared with the one the operator
was built for, so a serving directory pointing at the wrong base model refuses
to load.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from aloe_kernels.operator import weight_fingerprint

from .format import PARAM_NAMES, AloeSpec, AloeSpecError, down_proj_prefix
from .layer import AloeRowParallelLinear
from .reading import check_engine

__all__ = [
    "layer_keywords",
    "AloeLlamaForCausalLM",
    "AloeMistralForCausalLM",
    "AloeQwen2ForCausalLM",
    "AloeQwen3ForCausalLM",
]


def _text_config(vllm_config):
    config = vllm_config.model_config.hf_config
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def _aloe_dtype(vllm_config) -> torch.dtype:
    """Operator dtype: fp32 on CPU (like ``apply_aloe``), the model's dtype elsewhere."""
    from vllm.platforms import current_platform

    model_dtype = vllm_config.model_config.dtype
    if current_platform.is_cpu() or model_dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return torch.float32
    return model_dtype


def layer_keywords(old) -> dict:
    """The constructor keywords that rebuild the stock down-projection ``old`` (a ``RowParallelLinear``).

    Every keyword of ``RowParallelLinear.__init__`` but the sizes must be here, or the ALOE
    layer would silently take a default the stock one did not (the vLLM tests compare this set
    with the installed vLLM's signature).
    """
    return dict(
        bias=old.bias is not None,
        input_is_parallel=old.input_is_parallel,
        skip_bias_add=old.skip_bias_add,
        params_dtype=old.params_dtype,
        reduce_results=old.reduce_results,
        quant_config=old.quant_config,
        prefix=old.prefix,
        return_bias=old.return_bias,
        disable_tp=old.disable_tp,
    )


class _AloeMixin:
    """Installs the ALOE layer after the base ``__init__`` and checks the fingerprint while loading."""

    def __init__(self, *, vllm_config, prefix: str = "", **kwargs):
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._aloe_install(vllm_config)

    def _aloe_install(self, vllm_config) -> None:
        from vllm.model_executor.models.utils import PPMissingLayer

        config = _text_config(vllm_config)
        hf = vllm_config.model_config.hf_config
        source = f"{vllm_config.model_config.model}/config.json"
        spec = AloeSpec.from_config(hf if getattr(hf, "aloe", None) is not None else config, source)
        spec.check_model(
            num_layers=int(config.num_hidden_layers),
            d=int(config.intermediate_size),
            d_out=int(config.hidden_size),
            source=source,
        )
        check_engine(spec, vllm_config)
        self.aloe_spec = spec
        self._aloe_layer: AloeRowParallelLinear | None = None
        self._aloe_fingerprint_seen: str | None = None
        inner = self.model
        if not (inner.start_layer <= spec.layer < inner.end_layer):  # another pipeline stage holds it
            return
        block = inner.layers[spec.layer]
        if isinstance(block, PPMissingLayer):
            return
        mlp = block.mlp
        old = mlp.down_proj
        new = AloeRowParallelLinear(
            old.input_size, old.output_size, spec=spec, aloe_dtype=_aloe_dtype(vllm_config), **layer_keywords(old)
        )
        mlp.down_proj = new
        del old
        self._aloe_layer = new

    def _aloe_watch(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """Pass the weights through, fingerprinting the edited layer's base weight on the way."""
        target = down_proj_prefix(self.aloe_spec.layer) + ".weight"
        for name, tensor in weights:
            if name == target and self.aloe_spec.weight_fingerprint:
                found = weight_fingerprint(tensor)
                self._aloe_fingerprint_seen = found
                if found != self.aloe_spec.weight_fingerprint:
                    raise AloeSpecError(
                        f"ALOE: {target} has weight fingerprint {found}, but the operator in this serving "
                        f"directory was built for {self.aloe_spec.weight_fingerprint} "
                        f"(base model {self.aloe_spec.base_model or 'unknown'}, layer {self.aloe_spec.layer}): "
                        "wrong base model or layer; re-export with `aloe export-vllm`"
                    )
            yield name, tensor

    def _aloe_check_loaded(self) -> None:
        layer = self._aloe_layer
        if layer is None:
            return
        missing = [p for p in PARAM_NAMES if p not in layer.aloe_loaded]
        if missing:
            raise AloeSpecError(
                f"ALOE: the checkpoint has no tensors "
                f"{[down_proj_prefix(self.aloe_spec.layer) + '.' + m for m in missing]}; "
                f"expected them in {self.aloe_spec.tensors_file} (re-export with `aloe export-vllm`)"
            )
        if self.aloe_spec.weight_fingerprint and self._aloe_fingerprint_seen is None:
            raise AloeSpecError(
                f"ALOE: the base weight {down_proj_prefix(self.aloe_spec.layer)}.weight was not in the checkpoint, "
                "so the operator's weight fingerprint could not be checked"
            )
        layer.aloe_finalize()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(self._aloe_watch(weights))
        self._aloe_check_loaded()
        return loaded


from vllm.model_executor.models.llama import LlamaForCausalLM  # noqa: E402
from vllm.model_executor.models.mistral import MistralForCausalLM  # noqa: E402
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM  # noqa: E402
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM  # noqa: E402


class AloeLlamaForCausalLM(_AloeMixin, LlamaForCausalLM):
    """vLLM's LlamaForCausalLM (Llama 2/3, SmolLM2) with an ALOE operator on one down_proj."""


class AloeMistralForCausalLM(_AloeMixin, MistralForCausalLM):
    """vLLM's MistralForCausalLM with an ALOE operator on one down_proj."""


class AloeQwen2ForCausalLM(_AloeMixin, Qwen2ForCausalLM):
    """vLLM's Qwen2ForCausalLM with an ALOE operator on one down_proj."""


class AloeQwen3ForCausalLM(_AloeMixin, Qwen3ForCausalLM):
    """vLLM's Qwen3ForCausalLM with an ALOE operator on one down_proj."""
