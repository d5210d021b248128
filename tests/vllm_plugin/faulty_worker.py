"""A worker extension whose first commit fails on rank 1, after rank 0 has written its share:
the mid-commit fault of the tensor-parallel swap test (test_vllm_swap.py)."""

from __future__ import annotations

from aloe_vllm.worker import AloeWorkerExtension


class FaultyCommitExtension(AloeWorkerExtension):
    """``AloeWorkerExtension`` with one injected write failure on rank 1."""

    def aloe_commit(self, digest: str, ticket: str) -> dict | None:
        layer = self._aloe_layer()
        if self.rank != 1 or layer is None or getattr(self, "_aloe_fault_done", False):
            return super().aloe_commit(digest, ticket)
        self._aloe_fault_done = True
        place = layer._place_rows

        def broken(name, rows):
            if name == "aloe_writes":  # addresses, thresholds and temperatures are already written
                raise RuntimeError("injected write failure on rank 1")
            place(name, rows)

        layer._place_rows = broken
        try:
            return super().aloe_commit(digest, ticket)
        finally:
            del layer._place_rows
