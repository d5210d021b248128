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
- rank r gates and adds the writes of its own share of the slots
  ``[r*c//tp, (r+1)*c//tp)`` of the capacity c (``aloe_vllm::apply_from_scores_``),
  so the existing output all-reduce sums ``U g`` exactly once. Edits fill the
  slots in ``format.slot_order`` (the shares interleaved), so the writes of
  any first n edits are spread over the ranks.

With one rank this is a single pass through ``aloe_kernels.aloe_residual_``
(``aloe_vllm::residual_``: the fused Triton kernel on CUDA), or on CPU, for
operators of a few hundred edits and more, a screened path
(``aloe_vllm::screened_residual_``: a bf16 screen over all edits, exact fp32
gates for the few that may open; ``aloe_vllm::int8_screened_residual_``: the
same with an int8 screen, on CPUs without bf16 dot products; same result, a
fraction of the cost).

Live edits: the layer reserves ``capacity`` slots (config.json's ``aloe.capacity``,
default n); :meth:`AloeRowParallelLinear.aloe_swap_` copies a new operator into
its slots of the existing tensors (the first rows with one rank) and makes the rest inert
(``format.INERT``: gate exactly 0), so no shape or address changes. The CPU ops
read the live count (``aloe_active``) and skip the inert slots.
"""

from __future__ import annotations

import time

import torch
from torch.nn import Parameter

from aloe_kernels.operator import AloeOperator
from vllm.distributed import tensor_model_parallel_all_reduce
from vllm.model_executor.layers.linear import RowParallelLinear

from . import (
    ops,  # noqa: F401  (importing registers the torch.ops.aloe_vllm custom ops)
    positions,  # noqa: F401  (registers aloe_vllm::restore_unsampled_rows_)
)
from .format import INERT, PARAM_NAMES, AloeSpec, AloeSpecError, AloeSwapFailed, edit_share, slot_order
from .reading import ReadingTable
from .screen import refresh_int8_screen_, refresh_screen_, screen_buffers, screen_kind

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
        # The layer reserves spec.slots edit slots (capacity); rows past the live operator's n are inert,
        # so a live swap (aloe_swap_) rewrites tensors in place and never changes a shape.
        self.aloe_n = spec.slots
        self.aloe_eps = float(spec.eps)
        self.aloe_gate_eps = float(spec.gate_eps)
        self.aloe_lo, self.aloe_hi = edit_share(self.aloe_n, self.tp_rank, self.tp_size)
        self.aloe_slot_order = slot_order(self.aloe_n, self.tp_size)
        n_share = self.aloe_hi - self.aloe_lo
        d_shard = self.input_size_per_partition
        shapes = {
            "aloe_addresses": ((self.aloe_n, d_shard), aloe_dtype),
            "aloe_thresholds": ((n_share,), torch.float32),
            "aloe_temperatures": ((n_share,), torch.float32),
            "aloe_writes": ((n_share, output_size), aloe_dtype),
        }
        for name, (shape, dtype) in shapes.items():
            param = Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            param.data.fill_(INERT[name.removeprefix("aloe_")])
            param.weight_loader = self._make_aloe_loader(name)
            self.register_parameter(name, param)
        # Live edits in use (first rows); the CPU ops read it to skip the inert slots.
        self.register_buffer("aloe_active", torch.tensor([spec.n], dtype=torch.int64), persistent=False)
        self.aloe_active_n = spec.n
        self.aloe_operator_hash = spec.operator_fingerprint
        self.aloe_loaded_at: float | None = None
        self.aloe_loaded: set[str] = set()
        self.aloe_screen: str | None = None  # "bf16", "int8" or None (see screen.screen_kind)
        # gates that read a running mean keep one reading per KV-cache block (reading.py)
        self.aloe_reading: ReadingTable | None = None
        if spec.reading_decay:
            from vllm.config import get_current_vllm_config

            block_size = get_current_vllm_config().cache_config.block_size
            self.aloe_reading = ReadingTable(spec.reading_decay, block_size, f"model.layers.{spec.layer}.self_attn.attn")

    def aloe_finalize(self) -> None:
        """After loading: set up a screened CPU path if one applies (bf16 or int8 copies of the addresses)."""
        self.aloe_loaded_at = time.time()
        self.aloe_screen = screen_kind(self.aloe_n, self.aloe_addresses.device, self.tp_size)
        if self.aloe_screen is not None:
            for name, buf in screen_buffers(self.aloe_n, self.aloe_addresses, self.aloe_screen).items():
                self.register_buffer(name, buf, persistent=False)
            self._aloe_refresh_screen()

    def _aloe_refresh_screen(self) -> None:
        if self.aloe_screen == "int8":
            refresh_int8_screen_(
                self.aloe_screen_handle,
                self.aloe_addresses,
                self.aloe_thresholds,
                self.aloe_temperatures,
                self.aloe_gate_eps,
                self.aloe_active_n,
            )
            return
        refresh_screen_(
            self.aloe_addresses_lo,
            self.aloe_screen_handle,
            self.aloe_limit_lo,
            self.aloe_addresses,
            self.aloe_thresholds,
            self.aloe_temperatures,
            self.aloe_gate_eps,
            self.aloe_active_n,
        )

    # ---------------------------------------------------------------- loading
    def _runs(self, name: str, n: int) -> list[tuple[int, list[int]]]:
        """Where the first ``n`` edits sit in this rank's ``name``: (first row, the edits from there on).

        Edits occupy slots in :func:`slot_order` (the ranks' shares interleaved), so each share
        holds its edits in its leading rows: addresses (every slot) have one run per share,
        the other fields (this rank's share only) one run.
        """
        order = self.aloe_slot_order[:n]
        if name == "aloe_addresses":
            shares, base = [edit_share(self.aloe_n, r, self.tp_size) for r in range(self.tp_size)], 0
        else:
            shares, base = [(self.aloe_lo, self.aloe_hi)], self.aloe_lo
        return [(lo - base, [i for i, slot in enumerate(order) if lo <= slot < hi]) for lo, hi in shares]

    def _place_rows(self, name: str, rows: torch.Tensor) -> None:
        """Write the full (unsharded) edit rows ``rows`` (n, ...) into this rank's part of ``name``.

        Addresses keep every edit (this rank's columns of d); the other fields keep the rank's
        share of slots. Rows the previously live edits held past the new ones are reset to
        inert (later ones already are), so a smaller operator leaves no stale edit behind.
        """
        param = getattr(self, name)
        if name == "aloe_addresses":
            rows = rows.narrow(1, self.tp_rank * self.input_size_per_partition, self.input_size_per_partition)
        runs = zip(self._runs(name, rows.shape[0]), self._runs(name, self.aloe_active_n))
        for (start, edits), (_, before) in runs:
            k = len(edits)
            if k:  # one rank: the edits are 0..n-1 in order, a plain slice
                src = rows[edits[0] : edits[0] + k] if edits[-1] - edits[0] == k - 1 else rows[edits]
                param.data[start : start + k].copy_(src)
            if len(before) > k:
                param.data[start + k : start + len(before)].fill_(INERT[name.removeprefix("aloe_")])

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
            self._place_rows(name, loaded)
            self.aloe_loaded.add(name)

        return loader

    # ---------------------------------------------------------------- live swap
    def aloe_swap_(self, op: AloeOperator, operator_hash: str) -> dict:
        """Replace the live operator by ``op`` (already validated: ``aloe_vllm.swap.check_for_swap``), in place.

        Only the contents of the existing tensors change (their shapes and addresses stay), so
        compiled graphs stay valid. The caller runs this between two forward passes (vLLM's
        ``collective_rpc`` does, on every rank at the same step).

        All or nothing: the new rows are cast on the host first (so the writes allocate nothing
        on the device), and this rank's live rows are copied to the host before the first
        write; if any write fails, they are written back and AloeSwapFailed says so. If even
        that fails, the operator hash becomes ``"unknown"``. Returns that copy, for
        :meth:`aloe_undo_` (when another rank's swap failed).
        """
        if op.n > self.aloe_n:
            raise AloeSpecError(f"{self.prefix}: {op.n} edits do not fit in {self.aloe_n} slots")
        rows = {name: getattr(op, name.removeprefix("aloe_")).detach().to(getattr(self, name).dtype) for name in PARAM_NAMES}
        before = self._aloe_snapshot()
        try:
            self._aloe_write_(lambda name: self._place_rows(name, rows[name]), op.n)
        except Exception as exc:
            try:
                self.aloe_undo_(before)
            except Exception as again:
                self.aloe_operator_hash = "unknown"
                raise AloeSwapFailed(
                    f"{self.prefix}: the swap to {operator_hash} failed ({type(exc).__name__}: {exc}) and restoring "
                    f"the previous operator failed too ({type(again).__name__}); the served operator is unknown"
                ) from again
            raise AloeSwapFailed(
                f"{self.prefix}: the swap to {operator_hash} failed ({type(exc).__name__}: {exc}); "
                f"the previous operator {self.aloe_operator_hash} is live again"
            ) from exc
        self.aloe_operator_hash = operator_hash
        self.aloe_loaded_at = time.time()
        return before

    def aloe_undo_(self, before: dict) -> None:
        """Make the operator of a snapshot (:meth:`aloe_swap_`'s return) live again."""
        self._aloe_write_(lambda name: self._restore_rows(name, before), before["n"])
        self.aloe_operator_hash, self.aloe_loaded_at = before["hash"], before["loaded_at"]

    def _aloe_write_(self, place, n: int) -> None:
        """Write every operator tensor (``place(name)``), then the live count and the screen."""
        for name in PARAM_NAMES:
            place(name)
        self.aloe_active_n = n
        self.aloe_active.fill_(n)
        if self.aloe_screen is not None:
            self._aloe_refresh_screen()

    def _aloe_snapshot(self) -> dict:
        """This rank's live rows on the host, the live count and hash: what a failed swap writes back."""
        n = self.aloe_active_n
        saved = {"n": n, "hash": self.aloe_operator_hash, "loaded_at": self.aloe_loaded_at}
        for name in PARAM_NAMES:
            data = getattr(self, name).data
            saved[name] = [(start, data[start : start + len(edits)].to("cpu", copy=True)) for start, edits in self._runs(name, n)]
        return saved

    def _restore_rows(self, name: str, before: dict) -> None:
        """Write back the snapshot's rows of ``name``; every other row becomes inert again."""
        param = getattr(self, name)
        param.data.fill_(INERT[name.removeprefix("aloe_")])
        for start, rows in before[name]:
            param.data[start : start + rows.shape[0]].copy_(rows)

    def aloe_info(self) -> dict:
        """The live operator: ``n``, ``capacity``, ``operator_hash``, ``loaded_at`` (Unix seconds)."""
        return {
            "n": self.aloe_active_n,
            "capacity": self.aloe_n,
            "operator_hash": self.aloe_operator_hash,
            "loaded_at": self.aloe_loaded_at,
        }

    # ---------------------------------------------------------------- forward
    def _gate_input(self, h: torch.Tensor) -> torch.Tensor:
        """What the gates read of the layer input ``h``: ``h``, or its running reading."""
        if self.aloe_reading is None:
            return h
        squared = None
        if self.tp_size > 1:  # each rank holds a shard of h: the unit rows need the whole row's norm
            squared = tensor_model_parallel_all_reduce(h.float().pow(2).sum(-1, keepdim=True))
        return torch.ops.aloe_vllm.running_reading(h, squared, self.aloe_reading.key)

    def _add_aloe_(self, out: torch.Tensor, h: torch.Tensor) -> None:
        """Add this rank's part of ``U g(h)`` into the partial output, before the all-reduce."""
        if self.aloe_screen == "int8":
            torch.ops.aloe_vllm.int8_screened_residual_(
                out,
                h,
                self.aloe_screen_handle,
                self.aloe_addresses,
                self.aloe_thresholds,
                self.aloe_temperatures,
                self.aloe_writes,
                self.aloe_eps,
                self.aloe_gate_eps,
                self.aloe_active,
            )
            return
        if self.aloe_screen == "bf16":
            torch.ops.aloe_vllm.screened_residual_(
                out,
                h,
                self.aloe_addresses_lo,
                self.aloe_screen_handle,
                self.aloe_limit_lo,
                self.aloe_addresses,
                self.aloe_thresholds,
                self.aloe_temperatures,
                self.aloe_writes,
                self.aloe_eps,
                self.aloe_gate_eps,
                self.aloe_active,
            )
            return
        if self.tp_size == 1:
            torch.ops.aloe_vllm.residual_(
                out,
                h,
                self.aloe_addresses,
                self.aloe_thresholds,
                self.aloe_temperatures,
                self.aloe_writes,
                self.aloe_eps,
                self.aloe_gate_eps,
                self.aloe_active,
            )
            return
        scores = torch.ops.aloe_vllm.partial_scores(h, self.aloe_addresses)
        scores = tensor_model_parallel_all_reduce(scores)
        torch.ops.aloe_vllm.apply_from_scores_(
            out,
            scores,
            self.aloe_thresholds,
            self.aloe_temperatures,
            self.aloe_writes,
            self.aloe_eps,
            self.aloe_gate_eps,
            self.aloe_lo,
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
            # "generated": the residual stays only where the next token is sampled (positions.py)
            before = output_parallel.clone() if self.aloe_spec.write_positions == "generated" else None
            self._add_aloe_(output_parallel, self._gate_input(input_))
            if before is not None:
                torch.ops.aloe_vllm.restore_unsampled_rows_(output_parallel, before)
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
            + f", aloe_n={self.aloe_active_n}, aloe_capacity={self.aloe_n}"
            + f", aloe_share=[{self.aloe_lo}, {self.aloe_hi}), aloe_layer={self.aloe_spec.layer}"
            + f", aloe_screen={self.aloe_screen}"
        )
