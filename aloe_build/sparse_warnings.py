"""One place that quiets torch's notices about its sparse tensors, which every build would print."""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator


@contextlib.contextmanager
def quiet_sparse() -> Iterator[None]:
    """Silence the beta notice of sparse CSR tensors and the notice that invariant checks are off
    (torch >= 2.11 prints it even when ``check_invariants=False`` asks for exactly that)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Ss]parse CSR tensor support is in beta.*")
        warnings.filterwarnings("ignore", message=".*[Ss]parse invariant checks are implicitly disabled.*")
        yield
