"""How much CPU memory ``aloe serve`` lets vLLM take, sized from what is free.

vLLM's CPU backend reserves ``--gpu-memory-utilization`` (default 0.92) of the machine's whole memory
and refuses to start when less than that is free, so any other job on the machine stops it; when
it does start, the reservation leaves nothing for anyone else. ``aloe serve`` gives vLLM an
explicit KV cache size instead (``--kv-cache-memory-bytes``), which vLLM checks only against the
memory that is free: by default a quarter of what is free once the weights and the server's own
memory are set aside, between :data:`KV_MIN_BYTES` and :data:`KV_MAX_BYTES`; ``--memory`` sets it.
On a GPU vLLM's defaults stand. Nothing here imports vLLM.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Sequence

from .format import AloeSpecError

GIB = 2**30
#: the smallest KV cache chosen from free memory (SmolLM2's 8,192-token context takes 0.19 GiB in bf16)
KV_MIN_BYTES = GIB // 2
#: the largest KV cache chosen from free memory; more has to be asked for with --memory
KV_MAX_BYTES = 4 * GIB
#: the share of the memory left free (after weights and the server itself) that the KV cache takes
KV_SHARE = 0.25
#: the server's own memory beyond weights and KV cache: aloe serve, vLLM's API server, engine core and
#: worker each hold torch (resident sets measured serving SmolLM2 on a CPU: 0.27, 0.74, 0.67 and 1.3 GB
#: beside the worker's 4 GiB KV cache, 2.7 GB without the 0.27 GB of bf16 weights; rounded up)
SERVER_OVERHEAD_BYTES = 3 * GIB
#: vLLM's own options and the environment variable that already size its CPU memory
VLLM_MEMORY_OPTIONS = ("--kv-cache-memory-bytes", "--gpu-memory-utilization")
VLLM_MEMORY_ENV = "VLLM_CPU_KVCACHE_SPACE"

_UNITS = {"": 1, "b": 1, "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """Bytes in ``text``: a number with an optional unit, binary multiples (``4G``, ``4GiB``, ``512M``, ``1.5g``)."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(text).lower())
    if not match:
        raise AloeSpecError(f"--memory {text!r}: expected a size such as 4G, 512M or 1.5GiB")
    size = int(float(match.group(1)) * _UNITS[match.group(2)])
    if size <= 0:
        raise AloeSpecError(f"--memory {text!r}: must be more than zero")
    return size


def gib(n: int) -> str:
    """``n`` bytes in GiB, one decimal."""
    return f"{n / GIB:.1f} GiB"


def free_memory() -> tuple[int, int]:
    """``(available, total)`` bytes of this machine's memory (``MemAvailable`` on Linux)."""
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
        avail = os.sysconf("SC_AVPHYS_PAGES") if "SC_AVPHYS_PAGES" in os.sysconf_names else pages
        return avail * page, pages * page


def weight_bytes(model_dir: str | os.PathLike) -> int:
    """The size of a model directory's safetensors files (links followed): what its weights take at most."""
    return sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What ``aloe serve`` passes to vLLM for memory, and why.

    ``kv_bytes`` None: vLLM sizes its memory itself (a GPU, or the user gave vLLM's own options)."""

    kv_bytes: int | None
    reason: str

    def vllm_args(self) -> list[str]:
        return [] if self.kv_bytes is None else ["--kv-cache-memory-bytes", str(self.kv_bytes)]


def _given_to_vllm(vllm_args: Sequence[str], env: dict[str, str]) -> str | None:
    for arg in vllm_args:
        name = arg.split("=", 1)[0]
        if name in VLLM_MEMORY_OPTIONS:
            return name
    return VLLM_MEMORY_ENV if env.get(VLLM_MEMORY_ENV) else None


def plan_memory(
    model_dir: str | os.PathLike,
    requested: str | None,
    vllm_args: Sequence[str],
    env: dict[str, str],
    on_gpu: bool,
    memory: tuple[int, int] | None = None,
) -> MemoryPlan:
    """The KV cache size for a server of ``model_dir``: ``requested`` (``--memory``), else sized from
    free memory on a CPU (``memory``: ``(available, total)``, default :func:`free_memory`).

    Raises :class:`AloeSpecError`, saying what to change, when ``--memory`` conflicts with vLLM's own
    memory options or when the weights, the KV cache and the server do not fit in free memory."""
    given = _given_to_vllm(vllm_args, env)
    if given and requested:
        raise AloeSpecError(f"--memory and vLLM's {given} both size the KV cache: give one of them")
    if given:
        return MemoryPlan(None, f"vLLM's {given} sizes the memory")
    kv = parse_size(requested) if requested else None
    if on_gpu:
        return MemoryPlan(kv, f"KV cache {gib(kv)} (--memory)" if kv else "GPU: vLLM's defaults")
    available, total = memory or free_memory()
    weights = weight_bytes(model_dir)
    spare = available - weights - SERVER_OVERHEAD_BYTES
    if kv is None:
        kv = int(min(KV_MAX_BYTES, max(KV_MIN_BYTES, KV_SHARE * spare)))
        how = f"a quarter of the memory free beside the weights and the server, {KV_MIN_BYTES / GIB:g}-{KV_MAX_BYTES / GIB:g} GiB"
    else:
        how = "--memory"
    if kv > spare:
        raise AloeSpecError(
            f"not enough free memory to serve: the weights take up to {gib(weights)}, the server about "
            f"{gib(SERVER_OVERHEAD_BYTES)} and the KV cache {gib(kv)}, but {gib(available)} of {gib(total)} are free; "
            "free memory or give a smaller --memory (e.g. --memory 512M)"
        )
    return MemoryPlan(kv, f"KV cache {gib(kv)} of CPU memory ({how}; {gib(available)} free of {gib(total)})")
