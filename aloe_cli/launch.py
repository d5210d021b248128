"""``aloe build --procs N``: the same build run as N processes by torch's own launcher.

The command line is run again in each process (``python -m aloe_cli build ...`` without
``--procs``), which joins the group from the launcher's environment
(:func:`aloe_build.distributed.init_from_launcher`); ``torchrun --nproc_per_node N -m aloe_cli
build ...`` does the same. A process that fails stops the others, and the command names it.
"""

from __future__ import annotations

import os
import sys
import uuid
from typing import Sequence


def without_procs(argv: Sequence[str]) -> list[str]:
    """``argv`` less its ``--procs N`` (or ``--procs=N``)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--procs":
            skip = True
        elif not a.startswith("--procs="):
            out.append(a)
    return out


def launch(argv: Sequence[str], procs: int) -> int:
    """Run ``aloe`` with ``argv`` as ``procs`` processes on this machine; the exit status of the
    group (2, with the failed process named, when one fails)."""
    return launch_python(["-m", "aloe_cli", *without_procs(argv)], procs, f"aloe {argv[0] if argv else ''}")


def launch_python(python_args: Sequence[str], procs: int, what: str = "python") -> int:
    """``python *python_args`` as ``procs`` processes of one torch.distributed group on this
    machine (torch's elastic launcher, rendezvous on a free local port); 0, or 2 with the failed
    process named once the launcher has stopped the others."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # one thread per process unless told otherwise: N processes of all cores each would fight
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // procs)))
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=procs,
        run_id=f"aloe-{uuid.uuid4().hex[:8]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=0,
        monitor_interval=1,
    )
    try:
        elastic_launch(config, sys.executable)(*python_args)
    except ChildFailedError as exc:
        # a process whose partner died fails too, in its next collective: every failure is named,
        # and each printed its own error (the one that names a stage is the cause)
        failed = ", ".join(f"{rank} (exit {f.exitcode})" for rank, f in sorted(exc.failures.items()))
        print(f"{what}: error: of {procs} processes, {failed} failed; the others were stopped", file=sys.stderr)
        return 2
    return 0
