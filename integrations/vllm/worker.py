"""The worker side of live operator swaps: ``AloeWorkerExtension``, vLLM's ``worker_extension_cls``.

vLLM mixes this class into its worker class (``--worker-extension-cls
aloe_vllm.worker.AloeWorkerExtension``, or ``LLM(..., worker_extension_cls=...)``),
so ``collective_rpc("aloe_stage", ...)`` and friends run on every rank. The
protocol and its guarantees are described in :mod:`aloe_vllm.swap`.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

from .layer import AloeRowParallelLinear
from .swap import SwapRefused, load_for_swap

__all__ = ["AloeWorkerExtension"]


def _load_staged(path: str, layer: AloeRowParallelLinear) -> tuple[Any, str]:
    op = load_for_swap(path, layer.aloe_spec)
    return op, op.fingerprint()


class AloeWorkerExtension:
    """Swap methods added to vLLM's worker (``self`` is the worker)."""

    def _aloe_layer(self) -> AloeRowParallelLinear | None:
        runner = self.model_runner
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        layers = [m for m in model.modules() if isinstance(m, AloeRowParallelLinear)]
        return layers[0] if layers else None  # None: another pipeline stage holds the layer

    def aloe_stage(self, path: str) -> bool:
        """Start loading and checking the operator at ``path`` in the background; True if this rank holds the layer.

        The engine keeps stepping meanwhile (the load reads the file and hashes it, which takes
        a few hundred milliseconds for 10,000 edits).
        """
        layer = self._aloe_layer()
        if layer is None:
            return False
        fut: Future = Future()

        def run() -> None:
            try:
                fut.set_result(_load_staged(path, layer))
            except Exception as exc:  # reported to the client by aloe_staged
                fut.set_exception(exc)

        self._aloe_staging = fut
        threading.Thread(target=run, name="aloe-stage", daemon=True).start()
        return True

    def aloe_staged(self) -> dict | None:
        """``{"state": "pending" | "ok" | "error", "hash", "n", "error"}`` of the staged operator."""
        if self._aloe_layer() is None:
            return None
        fut = getattr(self, "_aloe_staging", None)
        if fut is None:
            return {"state": "error", "error": "nothing staged"}
        if not fut.done():
            return {"state": "pending"}
        exc = fut.exception()
        if exc is not None:
            reason = str(exc) if isinstance(exc, SwapRefused) else f"{type(exc).__name__}: {exc}"
            return {"state": "error", "error": reason}
        op, digest = fut.result()
        return {"state": "ok", "hash": digest, "n": op.n}

    def aloe_commit(self, digest: str) -> dict | None:
        """Make the staged operator (whose hash must be ``digest``) live; returns :meth:`aloe_operator_info`.

        Runs between two forward passes: vLLM executes a ``collective_rpc`` between engine steps.
        """
        layer = self._aloe_layer()
        if layer is None:
            return None
        fut = getattr(self, "_aloe_staging", None)
        if fut is None or not fut.done() or fut.exception() is not None or fut.result()[1] != digest:
            raise RuntimeError(f"aloe_commit: operator {digest} is not the one staged on this rank")
        op, _ = fut.result()
        layer.aloe_swap_(op, digest)
        self._aloe_staging = None
        return layer.aloe_info()

    def aloe_operator_info(self) -> dict | None:
        """The live operator of this rank: ``n``, ``capacity``, ``operator_hash``, ``loaded_at``."""
        layer = self._aloe_layer()
        return None if layer is None else layer.aloe_info()
