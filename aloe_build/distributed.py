"""A build spread over the processes of a torch.distributed group (``torchrun`` or ``aloe build --procs N``).

Every rank runs the same build: the same control flow, the same random draws and the same text
work. The passes through the model are split by chunk of sequences (:mod:`aloe_build.chunked`),
stage 6 by slot and stage 8 by the sequences of each batch; what each rank computed is gathered,
so that every rank holds each stage's result and the rest of the build goes on alike everywhere.
Only rank 0 writes files and shows progress. Outside a group (one process) every function here
is the identity of one rank, and nothing is communicated.
"""

from __future__ import annotations

import datetime
import os
import sys
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")

#: How long a rank waits in a collective before it gives up: a rank that died is normally seen by
#: the launcher at once, which stops the others; this bounds the wait where it is not.
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)


def active() -> bool:
    """Whether this process is one of several ranks of an initialized group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def is_main() -> bool:
    """Rank 0, the one that writes files, logs and shows progress (True in one process)."""
    return rank() == 0


def launched_ranks() -> int:
    """The world size a launcher (``torchrun``, ``aloe build --procs``) gave this process: 1 outside one."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_from_launcher(device: torch.device) -> bool:
    """Join the group a launcher set up (``WORLD_SIZE`` > 1 in the environment): NCCL where the
    model is on a GPU (each rank on GPU ``LOCAL_RANK``), gloo on CPU. Returns whether this is a
    distributed build; a no-op in one process or once joined."""
    if launched_ranks() <= 1 or dist.is_initialized():
        return active()
    if not dist.is_available():
        raise RuntimeError("this torch has no torch.distributed: build in one process")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
    return True


def local_rank() -> int:
    """The rank among the processes of this machine (the GPU a rank uses)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def _comm_device() -> torch.device:
    # NCCL moves only GPU tensors; gloo only CPU ones
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def gathered(obj: T) -> list[T]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if not active():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def from_main(obj: T) -> T:
    """Rank 0's ``obj`` on every rank (what a decision taken by rank 0 alone needs)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def summed(t: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of ``t`` over the ranks, on every rank (``t`` unchanged in one process)."""
    if not active():
        return t
    dev = _comm_device()
    buf = t.detach().to(dev, copy=True)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM)
    return buf.to(t.device)


def all_agree(flag: bool) -> bool:
    """Whether ``flag`` holds on every rank."""
    if not active():
        return flag
    return bool(summed(torch.tensor([0 if flag else 1], dtype=torch.int64)).item() == 0)


def barrier() -> None:
    if active():
        dist.barrier()


def own_name(name: str) -> str:
    """``name`` for what this rank alone holds, such as its pieces of a stage's work saved to resume
    (``name-rank0of2``); ``name`` itself in one process."""
    return f"{name}-rank{rank()}of{world_size()}" if active() else name


def takes(index: int) -> bool:
    """Whether this rank takes the ``index``-th of items dealt out in turn (blocks of a pass whose
    length is known only as it goes)."""
    return index % world_size() == rank()


def share(n: int) -> range:
    """This rank's share of ``n`` items (slots): every ``world_size``-th from its rank, so that
    items whose cost drifts along the stream fall to every rank alike."""
    return range(rank(), n, world_size())


def end_process(code: int) -> NoReturn:
    """End this rank's process now, its output flushed, without the interpreter's teardown: there a
    thread that the group left joinable can still abort a process whose build finished ("terminate
    called without an active exception"; one run in two of the two-process test on a loaded machine,
    after :func:`shutdown`)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shutdown(finished: bool) -> None:
    """Leave the group at the end of a distributed build. A rank that ``finished`` waits for the others
    first: one that tears its connections down while another still reads from them can make that one
    abort at exit. A rank that failed leaves at once (the others are stopped by the launcher)."""
    if dist.is_available() and dist.is_initialized():
        if finished and active():
            dist.barrier()
        dist.destroy_process_group()
