"""The streaming decode kernels' GPU configurations, compiled for sm_90 without a GPU.

Run as a script in a subprocess with TRITON_INTERPRET=0 (a process that imported Triton in
interpreter mode cannot compile). For each configuration the launcher picks on a GPU: no register
spills, shared memory within sm_90's limit; for kernel S, a 16-byte cp.async pipeline in its
streaming loop, and no division or warp shuffle on the path every step takes; bf16 addresses go
through wgmma. The full table, with Triton 3.6: benchmarks/results/gpu/aot_stream_sm90.md.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ != "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
H100_SHARED = 232448


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    sys.path.insert(0, str(ROOT))
    from aloe_kernels.ops.stream_kernels import jit_stream_kernels
    from benchmarks.aot.aot_stream_sm90 import _row_key, compile_config, default_rows

    kernels = jit_stream_kernels(False)
    out = {}
    for row in default_rows():
        try:
            out[repr(_row_key(row))] = compile_config(kernels, row)
        except Exception as exc:  # reported to the test
            out[repr(_row_key(row))] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    print("RESULTS " + json.dumps(out))


@pytest.fixture(scope="module")
def compiled():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(f"compile script failed (rc={proc.returncode}):\n{(proc.stderr or proc.stdout)[-3000:]}")
    return json.loads(lines[-1][len("RESULTS ") :])


def test_defaults_compile_without_spills(compiled):
    # S and W, bf16 and fp32, 16 and 32 tokens; the int8 screen and rescoring passes (bf16)
    assert len(compiled) == 12, sorted(compiled)
    for key, r in compiled.items():
        assert "error" not in r, (key, r.get("error"))
        assert r["spills"] == 0 and r["shared"] <= H100_SHARED, (key, r)


def test_streaming_loop_is_pipelined_without_divisions_or_shuffles(compiled):
    scores = {k: r for k, r in compiled.items() if k.startswith("('scores'")}
    assert len(scores) == 8
    for key, r in scores.items():
        step = r["step"]
        # the address tiles come in 16-byte copies (small side loads, flags or scales, may be narrower)
        assert step["cp.async"].endswith("16B") and not step["cp.async"].startswith("0x"), (key, step)
        assert step["div"] == 0 and step["shfl"] == 0, (key, step)
        if "'bf16'" in key:
            assert r["product"] == "wgmma", (key, r)


if __name__ == "__main__":
    main()
