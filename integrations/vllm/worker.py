"""The worker side of live operator swaps: ``AloeWorkerExtension``, vLLM's ``worker_extension_cls``.

vLLM mixes this class into its worker class (``--worker-extension-cls
aloe_vllm.worker.AloeWorkerExtension``, or ``LLM(..., worker_extension_cls=...)``),
so ``collective_rpc("aloe_stage", ...)`` and friends run on every rank. The
protocol and its guarantees are described in :mod:`aloe_vllm.swap`.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from .format import AloeSwapFailed
from .layer import AloeRowParallelLinear
from .swap import SwapRefused, load_for_swap

__all__ = ["STAGE_LEASE_S", "AloeWorkerExtension"]

log = logging.getLogger("aloe_vllm")

#: A staging slot held this long by a swap that never committed or released it (its client
#: died) may be taken by another swap.
STAGE_LEASE_S = 600.0


@dataclass
class _Staging:
    ticket: str
    started: float  # time.monotonic()
    result: Future  # (operator, hash) or the reason it was refused


def _load_staged(path: str, layer: AloeRowParallelLinear) -> tuple[Any, str]:
    op = load_for_swap(path, layer.aloe_spec)
    return op, op.fingerprint()


def _reason(exc: BaseException) -> str:
    """What the client is told: our own refusal messages in full; anything else by type only
    (its text may quote server internals), with the traceback in the server log."""
    if isinstance(exc, SwapRefused):
        return str(exc)
    log.error("ALOE: loading an operator for a live swap failed", exc_info=exc)
    return f"the operator could not be loaded ({type(exc).__name__}); the server log has the details"


class AloeWorkerExtension:
    """Swap methods added to vLLM's worker (``self`` is the worker)."""

    def _aloe_layer(self) -> AloeRowParallelLinear | None:
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        layers = [m for m in model.modules() if isinstance(m, AloeRowParallelLinear)]
        return layers[0] if layers else None  # None: another pipeline stage holds the layer

    def _aloe_owned(self, ticket: str) -> _Staging | None:
        staging = getattr(self, "_aloe_staging", None)
        return staging if staging is not None and staging.ticket == ticket else None

    def aloe_stage(self, path: str, ticket: str) -> dict | None:
        """Start loading and checking the operator at ``path`` in the background, for the swap ``ticket``.

        Returns ``{"state": "pending"}``, ``{"state": "busy", "error"}`` while another swap holds
        this rank's staging slot, or None where this rank holds no ALOE layer. The engine keeps
        stepping meanwhile (the load reads the file and hashes it, which takes a few hundred
        milliseconds for 10,000 edits).
        """
        layer = self._aloe_layer()
        if layer is None:
            return None
        held = getattr(self, "_aloe_staging", None)
        if held is not None and held.ticket != ticket and time.monotonic() - held.started < STAGE_LEASE_S:
            return {"state": "busy", "error": "another operator swap is in progress; retry once it has finished"}
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(_load_staged(path, layer))
            except Exception as exc:  # reported to the client by aloe_staged
                fut.set_exception(exc)

        self._aloe_staging = _Staging(ticket, time.monotonic(), fut)
        threading.Thread(target=run, name="aloe-stage", daemon=True).start()
        return {"state": "pending"}

    def aloe_staged(self, ticket: str) -> dict | None:
        """``{"state": "pending" | "ok" | "error", "hash", "n", "error"}`` of the operator staged for ``ticket``."""
        if self._aloe_layer() is None:
            return None
        staging = self._aloe_owned(ticket)
        if staging is None:
            return {"state": "error", "error": "nothing staged for this swap (released, or taken over after its lease)"}
        fut = staging.result
        if not fut.done():
            return {"state": "pending"}
        exc = fut.exception()
        if exc is not None:
            return {"state": "error", "error": _reason(exc)}
        op, digest = fut.result()
        return {"state": "ok", "hash": digest, "n": op.n}

    def aloe_commit(self, digest: str, ticket: str) -> dict | None:
        """Make the operator staged for ``ticket`` (whose hash must be ``digest``) live.

        Returns :meth:`aloe_operator_info` with ``"state": "ok"``, or ``"state": "error"`` and the
        reason (never raises: an exception from one rank of a ``collective_rpc`` leaves the other
        ranks' answers queued for the next call). Runs between two forward passes: vLLM executes a
        ``collective_rpc`` between engine steps. All ranks or none: if a write fails on any rank,
        every rank restores the previous operator within this call.
        """
        layer = self._aloe_layer()
        if layer is None:
            return None
        staging = self._aloe_owned(ticket)
        fut = staging.result if staging is not None else None
        if fut is None or not fut.done() or fut.exception() is not None or fut.result()[1] != digest:
            self._aloe_all_ranks_ok(False)  # the other ranks must not commit alone
            return {**layer.aloe_info(), "state": "error", "error": f"operator {digest} is not the one staged for this swap"}
        op, _ = fut.result()
        self._aloe_staging = None
        try:
            before, failure = layer.aloe_swap_(op, digest), None
        except AloeSwapFailed as exc:  # this rank is back on the old operator (or says it is unknown)
            before, failure = None, str(exc)
        if not self._aloe_all_ranks_ok(failure is None):
            if failure is None:  # this rank's swap worked, another's did not: all stay on the old one
                layer.aloe_undo_(before)
                failure = f"the swap to {digest} failed on another rank; this rank is back on {layer.aloe_operator_hash}"
            log.error("ALOE: %s", failure)
            return {**layer.aloe_info(), "state": "error", "error": failure}
        return {**layer.aloe_info(), "state": "ok"}

    def _aloe_all_ranks_ok(self, ok: bool) -> bool:
        """Whether every rank of the tensor-parallel group that holds the layer committed (a collective
        inside the same RPC, so no engine step sees a mix of operators)."""
        from vllm.distributed import get_tp_group

        group = get_tp_group()
        if group.world_size == 1:
            return ok
        flag = torch.tensor([int(ok)], dtype=torch.int32)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
        return bool(flag.item())

    def aloe_release(self, ticket: str) -> None:
        """Free this rank's staging slot if the swap ``ticket`` holds it (after a commit, refusal or timeout)."""
        if self._aloe_owned(ticket) is not None:
            self._aloe_staging = None

    def aloe_operator_info(self) -> dict | None:
        """The live operator of this rank: ``n``, ``capacity``, ``operator_hash``, ``loaded_at``."""
        layer = self._aloe_layer()
        return None if layer is None else layer.aloe_info()
