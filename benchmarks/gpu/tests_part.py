"""``tests`` part: the kernel test files, unchanged, on CUDA with compiled kernels.

``ALOE_TEST_DEVICE=cuda`` makes ``tests/conftest.py`` turn the interpreter off and
create tensors on the GPU (see there). pytest is not assumed on the GPU image:
without it the part fails with a clear message (the ``graph`` and ``acceptance``
parts still check the kernel on CUDA against float64).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

from .common import Context, PartResult, run_process

# The whole folder: test_kernel, test_kernel_compile, test_kernel_sparse, test_hf_patch, test_operator,
# test_reference, and any kernel test file added later.
KERNEL_TESTS = ("tests/kernels",)
# Smoke: a few cases that go through the interpreter and the float64 checks, in seconds.
SMOKE_TESTS = (
    "tests/kernels/test_kernel.py::test_fp32_all_open",
    "tests/kernels/test_reference.py::test_reference_matches_independent_float64",
)
TIMEOUT_S = 540


def _counts(junit: str) -> dict[str, int]:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    keys = ("tests", "failures", "errors", "skipped")
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in keys}


def run(ctx: Context) -> PartResult:
    """The ``tests`` part."""
    res = PartResult("tests")
    if importlib.util.find_spec("pytest") is None:
        res.status = "fail"
        res.log(
            f"pytest is not importable by {sys.executable} (Python {sys.version.split()[0]}): the kernel test "
            "files cannot run here. The graph and acceptance parts still check the kernel on CUDA. To run "
            "them, bring pure-Python pytest (with pluggy, iniconfig, packaging) on PYTHONPATH"
        )
        res.data["summary"] = "pytest missing"
        return res
    ctx.out.mkdir(parents=True, exist_ok=True)
    files = SMOKE_TESTS if ctx.smoke else KERNEL_TESTS
    env = dict(os.environ, ALOE_TEST_DEVICE="cuda" if ctx.cuda else "cpu")
    if not ctx.cuda:
        env["TRITON_INTERPRET"] = "1"
    # the counts are read from a JUnit file kept out of the results (a dump; tests.json holds the counts)
    with tempfile.TemporaryDirectory() as tmp:
        junit = Path(tmp) / "tests_junit.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", f"--junitxml={junit}", *files]
        rc, text, _ = run_process(cmd, env, TIMEOUT_S)
        counts = _counts(str(junit)) if junit.is_file() else {}
    (ctx.out / "tests_output.txt").write_text(" ".join(cmd) + "\n" + text)
    res.files.append(str(ctx.out / "tests_output.txt"))
    res.data.update(rc=rc, counts=counts, device=env["ALOE_TEST_DEVICE"], files=list(files))
    for line in text.strip().splitlines()[-12:]:
        res.log(line)
    if rc != 0:
        res.status = "fail"
    passed = counts.get("tests", 0) - sum(counts.get(k, 0) for k in ("failures", "errors", "skipped"))
    res.data["summary"] = (
        f"pytest rc={rc}: {passed} passed, {counts.get('failures', '?')} failed, "
        f"{counts.get('errors', '?')} errors, {counts.get('skipped', '?')} skipped "
        f"(ALOE_TEST_DEVICE={env['ALOE_TEST_DEVICE']})"
    )
    return res
