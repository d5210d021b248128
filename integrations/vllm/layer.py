"""``AloeRowParallelLinear``: vLLM's row-parallel down-projection plus the ALOE residual.

The layer computes ``W h`` exactly as its base class does (``quant_method.apply``,
which on CPU uses the repacked weight; the plain weight tensor is emptied after
loading), adds the ALOE residual into that *partial* output, and only then
runs the layer's usual output all-reduce. With tensor parallelism:

- ``aloe_addresses`` is sharded along d like the weight's input dimension
  (rank r holds columns ``[r*d/tp, (r+1)*d/tp)``, the slice of h it receives);
- each rank computes the partial scores and partial ``|h|^2`` of its slice
  (``aloe_vllm::partial_scores``), one all-reduce (sum) of that (T, n+1) fp32
  buffer over the TP group gives every rank the full scores;
- rank r gates and adds the writes of its own share of the edits
  ``[r*n//tp, (r+1)*n//tp)`` (``aloe_vllm::apply_from_scores_``), so the
  existing output all-reduce sums ``U g`` exactly once.

With one rank this is a single pass through ``aloe_kernels.aloe_residual_``
(``aloe_vllm::residual_``: the fused Triton kernel on CUDA), or on CPU, for
operators of a few hundred edits and more, the screened path
(``aloe_vllm::screened_residual_``: a bf16 screen over all edits, exact fp32
gates for the few that may open; same result, a fraction of the cost).
"""

from __future__ import annotations

import torch
from torch.nn import Parameter

from aloe_kernels.screened import screen_limit
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import RowParallelLinear

from . import ops  # noqa: F401  (importing registers the torch.ops.aloe_vllm custom ops)
from .format import AloeSpec, AloeSpecError, edit_share
from .screen import make_screen_gemm, screening_enabled

__all__ = ["AloeRowParallelLinear"]


class AloeRowParallelLinear(RowParallelLinear):
    """A ``RowParallelLinear`` holding an ALOE operator: ``out = W h + U g(h)``.

    The operator tensors are parameters named ``aloe_addresses`` (n, d/tp),
    ``aloe_thresholds`` / ``aloe_temperatures`` (n_share,) and ``aloe_writes``
    (n_share, d_out), filled by vLLM's weight loader from the checkpoint
    tensors ``<prefix>.aloe_*`` (full, unsharded on disk; each rank keeps its
    part).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        spec: AloeSpec,
        aloe_dtype: torch.dtype = torch.float32,
        **kwargs,
    ):
        super().__init__(input_size, output_size, **kwargs)
        if not self.input_is_parallel:
            raise ValueError("AloeRowParallelLinear expects input_is_parallel=True (vLLM's down_proj)")
        if (spec.d, spec.d_out) != (input_size, output_size):
            raise AloeSpecError(
                f"{self.prefix}: the operator maps d={spec.d} to d_out={spec.d_out}, but the layer maps "
                f"{input_size} to {output_size}"
            )
        self.aloe_spec = spec
        self.aloe_n = spec.n
        self.aloe_eps = float(spec.eps)
        self.aloe_gate_eps = float(spec.gate_eps)
        self.aloe_lo, self.aloe_hi = edit_share(spec.n, self.tp_rank, self.tp_size)
        n_share = self.aloe_hi - self.aloe_lo
        d_shard = self.input_size_per_partition
        shapes = {
            "aloe_addresses": ((spec.n, d_shard), aloe_dtype),
            "aloe_thresholds": ((n_share,), torch.float32),
            "aloe_temperatures": ((n_share,), torch.float32),
            "aloe_writes": ((n_share, output_size), aloe_dtype),
        }
        for name, (shape, dtype) in shapes.items():
            param = Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.weight_loader = self._make_aloe_loader(name)
            self.register_parameter(name, param)
        self.aloe_loaded: set[str] = set()
        self.aloe_screen = False

    def aloe_finalize(self) -> None:
        """After loading: set up the screened CPU path if it applies (bf16 copies of the addresses)."""
        self.aloe_screen = screening_enabled(self.aloe_n, self.aloe_addresses.device, self.tp_size)
        if self.aloe_screen:
            a_lo, handle = make_screen_gemm(self.aloe_addresses)
            self.register_buffer("aloe_addresses_lo", a_lo, persistent=False)
            self.register_buffer("aloe_screen_handle", handle, persistent=False)
            self.register_buffer("aloe_limit_lo", screen_limit(self.aloe_thresholds.detach(),
                                                               self.aloe_temperatures.detach(),
                                                               self.aloe_gate_eps), persistent=False)

    # ---------------------------------------------------------------- loading
    def _make_aloe_loader(self, name: str):
        spec = self.aloe_spec
        full = {
            "aloe_addresses": (spec.n, spec.d),
            "aloe_thresholds": (spec.n,),
            "aloe_temperatures": (spec.n,),
            "aloe_writes": (spec.n, spec.d_out),
        }[name]

        def loader(param: Parameter, loaded: torch.Tensor) -> None:
            where = f"{self.prefix}.{name}"
            if tuple(loaded.shape) != full:
                raise AloeSpecError(
                    f"ALOE operator tensor {where}: expected shape {full} (from config.json's aloe section), "
                    f"got {tuple(loaded.shape)}"
                )
            if not loaded.is_floating_point():
                raise AloeSpecError(f"ALOE operator tensor {where}: expected a floating dtype, got {loaded.dtype}")
            if loaded.numel() and not bool(torch.isfinite(loaded).all()):
                bad = int((~torch.isfinite(loaded)).sum())
                raise AloeSpecError(f"ALOE operator tensor {where}: {bad} NaN/Inf entries (corrupt operator?)")
            if name == "aloe_temperatures" and loaded.numel() and not bool((loaded > 0).all()):
                raise AloeSpecError(f"ALOE operator tensor {where}: every temperature must be > 0")
            if name == "aloe_addresses":
                part = loaded.narrow(1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition)
            else:
                part = loaded.narrow(0, self.aloe_lo, self.aloe_hi - self.aloe_lo)
            param.data.copy_(part)
            self.aloe_loaded.add(name)

        return loader

    # ---------------------------------------------------------------- forward
    def _add_aloe_(self, out: torch.Tensor, h: torch.Tensor) -> None:
        """Add this rank's part of ``U g(h)`` into the partial output, before the all-reduce."""
        if self.aloe_screen:
            torch.ops.aloe_vllm.screened_residual_(
                out, h, self.aloe_addresses_lo, self.aloe_screen_handle, self.aloe_limit_lo, self.aloe_addresses,
                self.aloe_thresholds,
                self.aloe_temperatures, self.aloe_writes, self.aloe_eps, self.aloe_gate_eps,
            )
            return
        if self.tp_size == 1:
            torch.ops.aloe_vllm.residual_(
                out, h, self.aloe_addresses, self.aloe_thresholds, self.aloe_temperatures, self.aloe_writes,
                self.aloe_eps, self.aloe_gate_eps,
            )
            return
        scores = torch.ops.aloe_vllm.partial_scores(h, self.aloe_addresses)
        scores = tensor_model_parallel_all_reduce(scores)
        torch.ops.aloe_vllm.apply_from_scores_(
            out, scores, self.aloe_thresholds, self.aloe_temperatures, self.aloe_writes,
            self.aloe_eps, self.aloe_gate_eps, self.aloe_lo,
        )

    def forward(self, input_):
        if not isinstance(input_, torch.Tensor):
            raise TypeError(
                f"{self.prefix}: ALOE needs the plain MLP activation, got {type(input_).__name__} "
                "(fused activation quantization is not supported on the edited layer)"
            )
        # Same as RowParallelLinear.forward, with the ALOE residual added into the
        # partial output before the reduction (so U g is summed exactly once).
        bias_ = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        output_parallel = self.quant_method.apply(self, input_, bias_)
        if self.aloe_n > 0:
            self._add_aloe_(output_parallel, input_)
        if self.reduce_results and self.tp_size > 1:
            output = tensor_model_parallel_all_reduce(output_parallel)
        else:
            output = output_parallel
        if not self.return_bias:
            return output
        output_bias = self.bias if self.skip_bias_add else None
        return output, output_bias

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", aloe_n={self.aloe_n}, aloe_share=[{self.aloe_lo}, {self.aloe_hi}), aloe_layer={self.aloe_spec.layer}"
            + f", aloe_screen={self.aloe_screen}"
        )
