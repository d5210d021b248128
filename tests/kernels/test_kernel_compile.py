"""Ahead-of-time compilation of the fused kernels for Hopper (sm_90), without a GPU.

The interpreter does not type-check a kernel the way the compiler does
(loop-carried types, scalar/block masks, dot shapes, shared memory). Triton's
NVIDIA backend ships ptxas, so the kernels can be lowered to a cubin on a
CPU-only machine. A process that imported Triton in interpreter mode cannot
compile (Triton's own library functions are interpreted there), so the test
runs this file as a script in a subprocess with TRITON_INTERPRET=0.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ != "__main__":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

H100_SHARED = 232448  # bytes of shared memory per block on sm_90
ROOT = Path(__file__).resolve().parents[2]

# (kernel, pointer dtypes, constexprs, num_warps)
GATE = "gate"


def _cases():
    def gate_ptrs(dt, out="fp32", src=None):
        return {
            "h_ptr": f"*{src or dt}",
            "a_ptr": f"*{dt}",
            "thr_ptr": f"*{dt}",
            "temp_ptr": f"*{dt}",
            "w_ptr": f"*{dt}",
            "out_ptr": f"*{out}",
            "flag_ptr": "*i32",
        }

    def gate_consts(mode, from_scores, dt, bt, bn, bd, bo, scaled=False, sliced=False):
        return {
            "MODE": mode,
            "FROM_SCORES": from_scores,
            "SCALED_NORM": scaled,
            "CAST_SCORES": False,
            "CAST_WRITES": dt == "fp32",
            "DOT_PREC": "ieee",
            "O_SLICED": sliced,
            "BLOCK_T": bt,
            "BLOCK_N": bn,
            "BLOCK_D": bd,
            "BLOCK_O": bo,
        }

    return {
        "decode_atomic_bf16": ("gate", gate_ptrs("bf16"), gate_consts(1, False, "bf16", 16, 32, 256, 128), 4),
        "prefill_partial_bf16": ("gate", gate_ptrs("bf16"), gate_consts(2, False, "bf16", 128, 128, 64, 128), 8),
        "tp_apply_partial_fp16": ("gate", gate_ptrs("fp16", src="fp32"), gate_consts(2, True, "fp16", 64, 64, 64, 128), 4),
        "split_k_apply_partial_bf16": (
            "gate",
            gate_ptrs("bf16", src="fp32"),
            gate_consts(2, True, "bf16", 16, 32, 64, 128, scaled=True),
            4,
        ),
        "split_k_apply_sliced_atomic_bf16": (
            "gate",
            gate_ptrs("bf16", src="fp32"),
            gate_consts(1, True, "bf16", 16, 32, 64, 64, scaled=True, sliced=True),
            4,
        ),
        "direct_fp32": ("gate", gate_ptrs("fp32"), gate_consts(0, False, "fp32", 64, 64, 128, 128), 4),
        "reduce_bf16": (
            "reduce",
            {"ws_ptr": "*fp32", "flag_ptr": "*i32", "y_ptr": "*bf16"},
            {"BLOCK_S": 32, "BLOCK_T": 1, "BLOCK_O": 128},
            4,
        ),
        "scores_bf16": (
            "scores",
            {"h_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*fp32"},
            {"SCALED_NORM": True, "CAST_SCORES": False, "DOT_PREC": "ieee", "BLOCK_T": 16, "BLOCK_N": 32, "BLOCK_D": 128},
            4,
        ),
    }


def main() -> None:
    """Compile every case for sm_90 and print one JSON object (name -> shared bytes or error)."""
    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    sys.path.insert(0, str(ROOT))
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from aloe_kernels.ops.gate_kernels import jit_kernels
    from benchmarks.aot.aot_sm90 import kernel_signature

    kernels = jit_kernels(False)
    target = GPUTarget("cuda", 90, 32)
    results = {}
    for name, (kname, ptrs, consts, warps) in _cases().items():
        fn = kernels[kname]
        sig = kernel_signature(fn, ptrs, consts)
        cx = {(fn.arg_names.index(k),): v for k, v in consts.items()}
        try:
            k = triton.compile(
                ASTSource(fn=fn, signature=sig, constexprs=cx), target=target, options={"num_warps": warps, "num_stages": 3}
            )
            results[name] = {"shared": int(k.metadata.shared)}
        except Exception as exc:  # reported to the test
            results[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
    print("RESULTS " + json.dumps(results))


@pytest.fixture(scope="module")
def compile_results():
    pytest.importorskip("triton")
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError as exc:  # pragma: no cover
        pytest.skip(f"this Triton has no ahead-of-time compile API: {exc}")
    env = dict(os.environ, TRITON_INTERPRET="0")
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())], env=env, cwd=str(ROOT), capture_output=True, text=True, timeout=600
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-3000:]
        if "ptxas" in tail.lower() and "not found" in tail.lower():  # pragma: no cover
            pytest.skip("Triton's ptxas is not available here")
        pytest.fail(f"compile script failed (rc={proc.returncode}):\n{tail}")
    return json.loads(lines[-1][len("RESULTS ") :])


@pytest.mark.parametrize("name", list(_cases()))
def test_kernel_compiles_for_sm90(compile_results, name):
    res = compile_results[name]
    assert "error" not in res, res.get("error")
    assert res["shared"] <= H100_SHARED


if __name__ == "__main__":
    main()
