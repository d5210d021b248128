"""``keep_freed_memory``: the large temporaries of a refinement-like loop stop being faulted in
afresh at every step."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

_LOOP = """
import resource, torch
from aloe_cli.memory import keep_freed_memory
took = keep_freed_memory()
torch.manual_seed(0)
V, owner, anchors = torch.randn(4000, 1536), torch.randint(0, 4000, (8000,)), torch.randn(8000, 1536)
(V[owner] * anchors).sum(-1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    s = (V[owner] * anchors).sum(-1)  # two 49 MB temporaries per step
print(int(took), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(keep: bool) -> tuple[bool, int]:
    env = {**os.environ, "ALOE_KEEP_FREED_MEMORY": "1" if keep else "0", "OMP_NUM_THREADS": "1"}
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _LOOP], env=env, cwd=root, capture_output=True, text=True, check=True)
    took, faults = out.stdout.split()
    return took == "1", int(faults)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
@pytest.mark.slow
def test_large_temporaries_reuse_freed_memory():
    took, kept = _faults(True)
    off, fresh = _faults(False)
    assert took and not off
    # 20 steps of two 12,000-page blocks: all faulted in again without, a fraction with
    assert fresh > 20 * 2 * 12000 * 0.9
    assert kept < fresh / 3
