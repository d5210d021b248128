"""The process's peak resident memory, as every baseline's info records it after its fit."""

from __future__ import annotations

import resource
import sys


def peak_memory_mb() -> float:
    """The process's peak resident memory so far, in MiB (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024
