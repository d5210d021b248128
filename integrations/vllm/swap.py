"""Live operator swaps: validation, and the stage / commit protocol over vLLM's ``collective_rpc``.

A swap replaces the served operator by the one in an artifact directory built
for the same base model, without restarting the engine:

1. ``aloe_stage(path, ticket)`` on every rank: a background thread checks the
   artifact's config and file sizes against the served layer before reading any
   tensor (:func:`precheck_for_swap`), then loads it on CPU and checks it
   (:func:`check_for_swap`); nothing live is touched and the engine keeps
   stepping meanwhile. Each rank has one staging slot, owned by the ticket of
   the swap that staged it: while another swap holds it, the stage is refused
   as busy (so two API-server processes cannot cross their swaps).
2. ``aloe_staged(ticket)`` is polled until every rank reports ``ok`` (same operator
   hash everywhere) or one reports an error, which refuses the swap.
3. ``aloe_commit(hash, ticket)`` on every rank copies the staged tensors into the
   layer's existing parameters (``AloeRowParallelLinear.aloe_swap_``), which
   restores the previous operator if any write fails.

vLLM runs a ``collective_rpc`` between two engine steps (the engine core's
busy loop handles it between steps; with tensor parallelism every worker takes
the broadcast in the same order relative to the step messages), so each
forward pass sees one operator version, and all ranks switch at the same step.
The worker side is :class:`aloe_vllm.worker.AloeWorkerExtension` (vLLM's
``worker_extension_cls``); this module has no vLLM import.

``swap_operator(llm, path)`` runs the protocol on an offline ``vllm.LLM``;
``aloe_vllm.admin`` runs it behind ``POST /v1/aloe/operator``.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from aloe_kernels.errors import ArtifactError
from aloe_kernels.operator import SUPPORTED_DTYPES, AloeOperator, artifact_files

from .format import AloeSpec, AloeSpecError, AloeSwapFailed

__all__ = [
    "EXTENSION",
    "RanksDisagree",
    "SwapBusy",
    "SwapRefused",
    "check_for_swap",
    "committed_info",
    "load_for_swap",
    "operator_info",
    "precheck_for_swap",
    "staged_hash",
    "swap_operator",
]

#: vLLM's ``worker_extension_cls`` that adds the swap methods to every worker.
EXTENSION = "aloe_vllm.worker.AloeWorkerExtension"


class SwapRefused(AloeSpecError):
    """An operator that may not replace the served one (the served one stays); the message says why."""


class SwapBusy(SwapRefused):
    """Another swap holds the staging slot; try again once it is done (the served operator stays)."""


class RanksDisagree(RuntimeError):
    """The ranks holding the ALOE layer report different live operators (``.infos`` holds each report)."""

    def __init__(self, infos: list[dict]):
        super().__init__(f"the ranks serve different operators: {[i.get('operator_hash') for i in infos]}")
        self.infos = infos


#: The largest ``aloe_config.json`` a swap reads (edit metadata; about 1 KB per edit).
CONFIG_MAX_BYTES = 64 << 20
#: Room for the safetensors header and alignment beyond the tensor bytes themselves.
_HEADER_SLACK_BYTES = 1 << 20


def precheck_for_swap(path: str | os.PathLike, spec: AloeSpec) -> None:
    """Refuse the artifact at ``path`` from its config, file sizes and tensor header, before any tensor is read.

    An oversized or mislabelled artifact must not be loaded into host memory on every rank just
    to be refused: the config's ``n``, ``d``, ``d_out`` and ``dtype`` are checked against the
    served layer, the tensor file may be no larger than those shapes need, and the shapes in its
    safetensors header must be the config's.
    """
    root = Path(path)
    try:
        cfg_path, t_path = artifact_files(root)
    except ArtifactError as exc:
        raise SwapRefused(str(exc)) from exc
    if cfg_path.stat().st_size > CONFIG_MAX_BYTES:
        raise SwapRefused(f"{cfg_path}: larger than {CONFIG_MAX_BYTES >> 20} MiB; not an operator config")
    try:
        config = json.loads(cfg_path.read_text())
        n, d, d_out = (int(config[k]) for k in ("n", "d", "d_out"))
        itemsize = SUPPORTED_DTYPES[config["dtype"]].itemsize
    except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError) as exc:
        raise SwapRefused(f"{cfg_path}: not a readable operator config ({type(exc).__name__}: {exc})") from exc
    _check_sizes(n, d, d_out, spec, str(root))
    limit = n * (d + d_out + 2) * itemsize + _HEADER_SLACK_BYTES
    if t_path.stat().st_size > limit:
        raise SwapRefused(f"{t_path}: {t_path.stat().st_size} bytes, more than the {limit} that n={n} edits need")
    want = {"addresses": (n, d), "thresholds": (n,), "temperatures": (n,), "writes": (n, d_out)}
    got = _header_shapes(t_path)
    for name, shape in want.items():
        if got.get(name) != shape:
            raise SwapRefused(
                f"{t_path}: tensor '{name}' has shape {got.get(name)} in the file's header; its config says {shape}"
            )


def _header_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor shapes from a safetensors header (no tensor is read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as exc:  # the library raises its own error types for a malformed header
        raise SwapRefused(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from exc


def _check_sizes(n: int, d: int, d_out: int, spec: AloeSpec, source: str) -> None:
    if (d, d_out) != (spec.d, spec.d_out):
        raise SwapRefused(f"{source}: the operator maps d={d} to d_out={d_out}, the served layer maps {spec.d} to {spec.d_out}")
    if n > spec.slots:
        raise SwapRefused(
            f"{source}: the operator has n={n} edits, more than the capacity of {spec.slots} "
            "slots the server reserved (serve with a larger --max-edits)"
        )


def _reading(decay: float) -> str:
    return f"a running mean of decay {decay}" if decay else "the last token's state"


def check_for_swap(op: AloeOperator, spec: AloeSpec, source: str = "operator") -> None:
    """Refuse ``op`` unless it fits the served layer described by ``spec`` (SwapRefused names the problem).

    The operator's own load already checked shapes, dtypes, finiteness and temperatures > 0. Here:
    the base weight fingerprint (required: a live swap must not guess), layer, d / d_out, the
    number of edits against the reserved slots, the reading decay, and eps / gate_eps, which the served graph holds
    as constants.
    """
    if float(op.reading_decay) != float(spec.reading_decay):
        raise SwapRefused(
            f"{source}: its gates read {_reading(op.reading_decay)}, the served layer's {_reading(spec.reading_decay)}; "
            "the running reading of the requests in flight is kept for the served decay (restart the server)"
        )
    if not op.weight_fingerprint:
        raise SwapRefused(
            f"{source}: the operator records no weight fingerprint, so it cannot be checked against the served base model"
        )
    if spec.weight_fingerprint and op.weight_fingerprint != spec.weight_fingerprint:
        raise SwapRefused(
            f"{source}: weight fingerprint mismatch: the operator was built for a down_proj weight with "
            f"fingerprint {op.weight_fingerprint} ({op.base_model or 'unknown base'}), but the served model "
            f"has {spec.weight_fingerprint} at layer {spec.layer}: wrong base model or layer"
        )
    if op.layer is not None and op.layer != spec.layer:
        raise SwapRefused(f"{source}: the operator edits layer {op.layer}, the served operator layer {spec.layer}")
    _check_sizes(op.n, op.d, op.d_out, spec, source)
    if (float(op.eps), float(op.gate_eps)) != (float(spec.eps), float(spec.gate_eps)):
        raise SwapRefused(
            f"{source}: the operator has eps={op.eps}, gate_eps={op.gate_eps}; the served layer "
            f"was set up with eps={spec.eps}, gate_eps={spec.gate_eps}"
        )


def load_for_swap(path: str | os.PathLike, spec: AloeSpec) -> AloeOperator:
    """Check the artifact at ``path`` (:func:`precheck_for_swap`), load it on CPU and check it
    (:func:`check_for_swap`); SwapRefused on any problem."""
    precheck_for_swap(path, spec)
    try:
        op = AloeOperator.load(path)
    except (ArtifactError, OSError, ValueError) as exc:
        raise SwapRefused(str(exc)) from exc
    check_for_swap(op, spec, str(path))
    return op


def operator_info(infos: list[dict | None]) -> dict:
    """The served operator as ``GET /v1/aloe/operator`` reports it, from the ranks' ``aloe_operator_info()``.

    ``ranks`` counts the ranks holding the layer and ``rank_hashes`` lists each one's operator
    hash. RanksDisagree when they do not all serve the same operator (a failed rollback).
    """
    live = [i for i in infos if i]
    if not live:
        raise RuntimeError("no worker holds an ALOE layer (is this an ALOE serving directory?)")
    if len({(i["n"], i["operator_hash"]) for i in live}) != 1:
        raise RanksDisagree(live)
    info = {k: live[0][k] for k in ("n", "capacity", "operator_hash", "loaded_at")}
    return {**info, "ranks": len(live), "rank_hashes": [i["operator_hash"] for i in live]}


def committed_info(results: list[dict | None]) -> dict:
    """The new operator's :func:`operator_info` from the ranks' ``aloe_commit`` answers.

    AloeSwapFailed (with the first rank's reason) when a rank failed: every rank is then back on
    the previous operator, and ``.operator`` holds what they report.
    """
    live = [r for r in results if r]
    failed = [r["error"] for r in live if r.get("state") != "ok"]
    if failed:
        exc = AloeSwapFailed(failed[0])
        try:
            exc.operator = operator_info(live)
        except RanksDisagree as disagree:
            exc.operator = {"ranks_disagree": disagree.infos}
        raise exc
    return operator_info(live)


def staged_hash(states: list[dict | None]) -> str | None:
    """The staged operator's hash once every rank holding the layer has it; None while one is loading.

    Raises SwapRefused with the first rank's reason when a rank refused it (SwapBusy when
    another swap holds a rank's staging slot).
    """
    live = [s for s in states if s]
    for s in live:
        if s["state"] == "busy":
            raise SwapBusy(s["error"])
        if s["state"] == "error":
            raise SwapRefused(s["error"])
    if not live or any(s["state"] != "ok" for s in live):
        return None
    hashes = {s["hash"] for s in live}
    if len(hashes) != 1:  # the file changed between the ranks' reads
        raise SwapRefused(f"the ranks read different operators ({sorted(hashes)}); was the artifact rewritten?")
    return hashes.pop()


def new_ticket() -> str:
    """A fresh swap ticket: the owner of the workers' staging slots for one swap."""
    return uuid.uuid4().hex


def swap_operator(
    llm: Any, path: str | os.PathLike, timeout: float = 300.0, poll: Callable[[], None] = lambda: time.sleep(0.01)
) -> dict:
    """Swap the operator served by an offline ``vllm.LLM`` (created with ``worker_extension_cls=EXTENSION``).

    Returns the new :func:`operator_info`; raises SwapRefused (the old operator keeps serving)
    when the artifact is refused, AloeSwapFailed when a rank's write failed (every rank is back on
    the old operator). Call it between ``generate`` calls (the engine applies it
    between steps in any case).
    """
    where = str(Path(path).expanduser().resolve())
    ticket = new_ticket()
    try:
        staged_hash(llm.collective_rpc("aloe_stage", args=(where, ticket)))
        deadline = time.monotonic() + timeout
        while (digest := staged_hash(llm.collective_rpc("aloe_staged", args=(ticket,)))) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{where}: not staged after {timeout:.0f}s")
            poll()
        info = committed_info(llm.collective_rpc("aloe_commit", args=(digest, ticket)))
    finally:
        llm.collective_rpc("aloe_release", args=(ticket,))
    # Cached prefixes hold KV computed under the old operator; between generate calls nothing
    # runs, so the reset succeeds.
    llm.reset_prefix_cache()
    return info
