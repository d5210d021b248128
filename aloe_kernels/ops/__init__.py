"""Fused Triton kernels. Importing this package never fails without Triton
(its modules need it); ``kernel_available()`` says whether the kernels can run.

- ``gate_kernels.py``: the Triton kernels (design notes in its docstring);
- ``aloe_gate.py``: their launcher and the single-rank fused op
  ``aloe_gate_residual_`` (``torch.ops.aloe.gate_residual_``);
- ``tensor_parallel.py``: the two-phase split for tensor parallelism
  (``aloe_gate_partial_scores``, ``aloe_gate_apply_``);
- ``launch_plan.py``: mode, edit split, block sizes and autotuning spaces;
- ``checks.py``: argument checks of the public entry points.
"""

from __future__ import annotations

from ..runtime import kernel_available

__all__ = ["kernel_available"]
