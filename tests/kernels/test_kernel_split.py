"""The split paths of the fused gate kernel: split-K (d slices scored first), the tiled
reduction of the edit splits, the grid-stride phase A and strided gate parameters.

Every result is compared with a float64 evaluation of the ALOE formula on the
same (rounded) inputs (``ref_delta`` of test_kernel). Workspaces are poisoned
(NaN, or a non-zero flag) so that a read of an element the kernels did not
write shows up.
"""

import pytest
import torch

# The interpreter set-up, skip condition and kernel modules of test_kernel (imported first there).
from test_kernel import (  # noqa: F401  (pytestmark applies to this module too)
    FP32_TOL,
    HALF_TOL,
    cast_op,
    gate,
    make_case,
    plan,
    pytestmark,
    ref_delta,
    rel_err,
    tp,
)

# d=80 with block_d=16 -> several d tiles per slice, slices of 27/27/26 columns for k_split=3.
D, D_OUT = 80, 24
SMALL = dict(block_t=16, block_n=16, block_d=16, block_o=16)


@pytest.fixture(autouse=True)
def poisoned_workspaces(monkeypatch):
    """Fill every kernel workspace with NaN (fp32) or 1 (int flags: 'this row was written')."""
    buffers = pytest.importorskip("aloe_kernels.ops.buffers")
    real = buffers.empty_workspace

    def poisoned(shape, device, dtype):
        t = real(shape, device, dtype)
        return t.fill_(float("nan") if dtype.is_floating_point else 1)

    monkeypatch.setattr(buffers, "empty_workspace", poisoned)


def run(y, h, op, **kw):
    args = dict(SMALL)
    args.update(kw)
    return gate.aloe_gate_residual_(y, h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps, **args)


# ------------------------------------------------------------- split-K
@pytest.mark.parametrize(
    "T,n,k_split,split,det",
    [
        (1, 1, 2, 0, False),
        (1, 50, 3, 4, False),
        (1, 50, 3, 4, True),
        (7, 3, 2, 1, False),
        (7, 50, 3, 2, True),
        (20, 37, 5, 3, False),
    ],
)
def test_split_k_fp32_matches_float64(T, n, k_split, split, det):
    h, op = make_case(T, D, D_OUT, n, "mixed", seed=T * 31 + n)
    ref, g = ref_delta(h, op)
    if T * n > 1:
        assert (g > 0).any() and (g == 0).any()
    y = torch.full((T, D_OUT), 0.25)  # the kernel adds into y: 0.25 must stay under the delta
    run(y, h, op, deterministic=det, split=split, k_split=k_split)
    assert rel_err(y.double() - 0.25, ref) <= FP32_TOL


@pytest.mark.parametrize(
    "dtype,ydtype,det",
    [
        (torch.bfloat16, torch.bfloat16, False),
        (torch.float16, torch.float16, True),
        (torch.bfloat16, torch.float32, True),
    ],
)
def test_split_k_half_inputs(dtype, ydtype, det):
    h, op = make_case(7, D, D_OUT, 60, "mixed", seed=17)
    h, op = h.to(dtype), cast_op(op, dtype)
    ref, _ = ref_delta(h, op)
    y = torch.zeros(7, D_OUT, dtype=ydtype)
    run(y, h, op, deterministic=det, split=3, k_split=4)
    assert rel_err(y, ref) <= HALF_TOL


def test_split_k_all_open_and_all_closed():
    h, op = make_case(7, D, D_OUT, 40, "open", seed=3)
    ref, g = ref_delta(h, op)
    assert bool((g > 0.99).all())
    y = torch.zeros(7, D_OUT)
    run(y, h, op, split=3, k_split=2)
    assert rel_err(y, ref) <= FP32_TOL
    h, op = make_case(7, D, D_OUT, 40, "closed", seed=3)
    assert bool((ref_delta(h, op)[1] == 0).all())
    y = torch.randn(7, D_OUT).to(torch.bfloat16)
    before = y.clone()
    run(y, h.to(torch.bfloat16), cast_op(op, torch.bfloat16), split=3, k_split=2)
    assert torch.equal(y.view(torch.int16), before.view(torch.int16))


def test_split_k_extreme_and_zero_rows():
    """The scaled per-slice norms merge without overflow (1e30 rows) and zero rows stay finite."""
    h, op = make_case(8, D, D_OUT, 30, "mixed", seed=14, zero_rows=(7,))
    h = h * torch.tensor([1e-30, 1e-3, 1.0, 1e3, 1e15, 1e25, 1e30, 1.0]).unsqueeze(1)
    h[2, 40:] = 0.0  # a row that is zero in some d slices only
    op.thresholds[:10] = -0.05  # the zero row opens these
    ref, g = ref_delta(h, op)
    assert (g[7] > 0).any()
    y = torch.zeros(8, D_OUT)
    run(y, h, op, split=2, k_split=3)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) <= FP32_TOL


def test_split_k_deterministic_bits():
    h, op = make_case(7, D, D_OUT, 90, "open", seed=4)
    h, op = h.to(torch.bfloat16), cast_op(op, torch.bfloat16)
    outs = []
    for _ in range(2):
        y = torch.zeros(7, D_OUT, dtype=torch.bfloat16)
        run(y, h, op, deterministic=True, split=5, k_split=3)
        outs.append(y)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert rel_err(outs[0], ref_delta(h, op)[0]) <= HALF_TOL


def test_split_k_phase_a_grid_cap(monkeypatch):
    """With the edit-block axis capped at 2 programs, the grid-stride loop still scores every edit."""
    monkeypatch.setattr(plan, "MAX_GRID_Y", 2)
    h, op = make_case(7, D, D_OUT, 100, "mixed", seed=23)  # 7 blocks of 16 edits
    ref, _ = ref_delta(h, op)
    y = torch.zeros(7, D_OUT)
    run(y, h, op, split=3, k_split=2)
    assert rel_err(y, ref) <= FP32_TOL


# ------------------------------------------------------ d_out slices
# D_OUT = 24 with block_o = 16: slices narrower than one tile (5 of 5 columns and one of 4), one tile
# and a ragged one (2 of 12), one column each (more slices asked than columns).
@pytest.mark.parametrize(
    "T,n,k_split,o_split,split,ydtype,det",
    [
        (1, 1, 2, 5, 0, torch.bfloat16, False),  # partial mode, one edit, one token
        (1, 50, 3, 2, 4, torch.float32, False),  # atomic
        (7, 50, 2, 5, 1, torch.float32, True),  # direct (one edit range)
        (7, 50, 3, 30, 3, torch.float32, True),  # partial, deterministic fp32
        (20, 37, 2, 3, 3, torch.float16, False),  # two token tiles
    ],
)
def test_write_slices_match_float64(T, n, k_split, o_split, split, ydtype, det):
    h, op = make_case(T, D, D_OUT, n, "mixed", seed=T * 7 + n + o_split)
    if ydtype != torch.float32:
        h, op = h.to(ydtype), cast_op(op, ydtype)
    ref, g = ref_delta(h, op)
    if T * n > 1:
        assert (g > 0).any() and (g == 0).any()
    base = 0.25 if ydtype == torch.float32 else 0.0  # the kernel adds into y; 16-bit y has no room for a base
    y = torch.full((T, D_OUT), base).to(ydtype)
    run(y, h, op, deterministic=det, split=split, k_split=k_split, o_split=o_split)
    tol = FP32_TOL if ydtype == torch.float32 else HALF_TOL
    assert rel_err(y.double() - base, ref) <= tol


def test_write_slices_all_open_all_closed_and_bits():
    h, op = make_case(7, D, D_OUT, 40, "open", seed=8)
    ref, g = ref_delta(h, op)
    assert bool((g > 0.99).all())
    y = torch.zeros(7, D_OUT)
    run(y, h, op, split=3, k_split=2, o_split=3)
    assert rel_err(y, ref) <= FP32_TOL
    h, op = make_case(7, D, D_OUT, 40, "closed", seed=8)
    assert bool((ref_delta(h, op)[1] == 0).all())
    y = torch.randn(7, D_OUT).to(torch.bfloat16)
    before = y.clone()
    run(y, h.to(torch.bfloat16), cast_op(op, torch.bfloat16), split=3, k_split=2, o_split=4)
    assert torch.equal(y.view(torch.int16), before.view(torch.int16))
    # deterministic: slicing d_out does not change a bit of the result
    h, op = make_case(7, D, D_OUT, 90, "mixed", seed=9)
    h, op = h.to(torch.bfloat16), cast_op(op, torch.bfloat16)
    outs = []
    for o_split in (1, 3):
        y = torch.zeros(7, D_OUT, dtype=torch.bfloat16)
        run(y, h, op, deterministic=True, split=5, k_split=3, o_split=o_split)
        outs.append(y)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_write_slices_chosen_for_tensor_parallel_phase_b(monkeypatch):
    """Phase B of the tensor-parallel split (a gate reading scores) takes the automatic d_out slices."""
    monkeypatch.setattr(plan, "_O_GRAIN", 8)
    monkeypatch.setattr(plan, "_WRITE_PROGRAMS_PER_SM", 6)
    assert plan.plan_launch(7, 20, D_OUT, torch.float32, True, 1, split=2).o_split == 3
    h, op = make_case(7, 48, D_OUT, 20, "mixed", seed=21)
    scores = tp.aloe_gate_partial_scores(h, op.addresses)
    ref, _ = ref_delta(h, op)
    for det in (True, False):
        y = torch.zeros(7, D_OUT)
        tp.aloe_gate_apply_(
            y,
            scores,
            op.thresholds,
            op.temperatures,
            op.writes,
            op.eps,
            op.gate_eps,
            deterministic=det,
            split=2,
            block_t=16,
            block_n=16,
            block_o=16,
        )
        assert rel_err(y, ref) <= FP32_TOL


# --------------------------------------------------- tiled reduction
@pytest.mark.parametrize(
    "T,n,split,ydtype",
    [
        (1, 200, 40, torch.bfloat16),  # 40 splits: two reduction steps of 32 (the second ragged)
        (7, 200, 33, torch.float32),  # deterministic fp32: the partial mode
        (20, 100, 7, torch.float16),
    ],
)
def test_reduce_many_splits(T, n, split, ydtype):
    h, op = make_case(T, 48, D_OUT, n, "mixed", seed=T + split)
    opp = op if ydtype == torch.float32 else cast_op(op, ydtype)
    hh = h.to(ydtype)
    ref, g = ref_delta(hh, opp)
    closed_rows = (g == 0).all(dim=1)
    y = torch.randn(T, D_OUT).to(ydtype)
    before = y.clone()
    run(y, hh, opp, deterministic=True, split=split)
    tol = FP32_TOL if ydtype == torch.float32 else HALF_TOL
    assert rel_err(y.double() - before.double(), ref) <= tol * (1 + float(before.abs().max() / ref.abs().max()))
    assert torch.equal(y[closed_rows], before[closed_rows])  # rows no gate opens keep their exact bits


def test_reduce_blocks_shapes():
    for T, s, d_out in ((1, 82, 4096), (1, 1, 4096), (7, 3, 24), (4096, 2, 4096), (16, 500, 576)):
        rb = plan.reduce_blocks(T, s, d_out)
        assert all(v & (v - 1) == 0 for v in rb.values())
        assert rb["BLOCK_S"] * rb["BLOCK_T"] * rb["BLOCK_O"] <= 4096
        assert rb["BLOCK_S"] <= 32 and rb["BLOCK_S"] >= min(s, 32) and rb["BLOCK_T"] <= max(1, 2 * T)


# ------------------------------------------------ phase A / params
def test_partial_scores_grid_cap(monkeypatch):
    monkeypatch.setattr(plan, "MAX_GRID_Y", 2)
    h, op = make_case(5, 48, D_OUT, 100, "mixed", seed=2)
    p = tp.aloe_gate_partial_scores(h, op.addresses, block_t=16, block_n=16, block_d=16)
    exact = h.double() @ op.addresses.double().T
    assert torch.isfinite(p).all()
    assert float((p[:, :100].double() - exact).abs().max()) <= 1e-5 * float(exact.abs().max())
    assert torch.allclose(p[:, 100].double(), (h.double() ** 2).sum(1), rtol=1e-5)


def test_strided_thresholds_and_temperatures():
    h, op = make_case(7, 48, D_OUT, 30, "mixed", seed=19)
    ref, _ = ref_delta(h, op)
    thr = torch.stack([op.thresholds, torch.full_like(op.thresholds, 9.0)], 1)[:, 0]  # stride 2
    temp = torch.stack([torch.zeros_like(op.temperatures), op.temperatures], 1)[:, 1]  # stride 2, offset 1
    assert thr.stride(0) == 2 and temp.stride(0) == 2
    for kw in ({"split": 2}, {"split": 2, "k_split": 2}):
        y = torch.zeros(7, D_OUT)
        gate.aloe_gate_residual_(y, h, op.addresses, thr, temp, op.writes, op.eps, op.gate_eps, **SMALL, **kw)
        assert rel_err(y, ref) <= FP32_TOL


# ------------------------------------------------------------ planning
def test_plan_k_split():
    P = plan.plan_launch
    p = P(1, 1301, 4096, torch.bfloat16, False, 132, d=4096)
    assert p.k_split > 1 and p.launches == 3
    assert p.d_per_split % 256 == 0 and p.d_per_split * p.k_split >= 4096 > p.d_per_split * (p.k_split - 1)
    assert P(1, 1301, 4096, torch.float32, False, 132, d=4096).launches == 2
    assert P(1, 10000, 4096, torch.bfloat16, False, 132, d=4096).k_split == 1  # enough edit blocks
    assert P(1, 10000, 4096, torch.bfloat16, False, 132, d=4096).split <= 132  # decode: one range per SM
    assert P(4096, 1301, 4096, torch.bfloat16, False, 132, d=4096).k_split == 1  # enough token tiles
    assert P(1, 1301, 4096, torch.bfloat16, False, 132).k_split == 1  # from scores: no d
    assert P(1, 30, 100, torch.float32, False, 132, d=100).k_split == 1  # d too narrow to slice
    p = P(1, 5, 24, torch.float32, False, 1, d=80, k_split=3)
    assert (p.k_split, p.d_per_split) == (3, 27)
    assert [plan.n_bucket(n) for n in (1, 16, 17, 1301, 10000)] == [16, 16, 32, 2048, 16384]
    # a decode batch of 32 on 1,301 edits is split like a batch of 1 (one token tile of 64)
    assert P(32, 1301, 4096, torch.bfloat16, False, 132, d=4096).k_split > 1
    # 163 edit blocks (fewer than 2 per SM): at least 4 slices
    assert P(1, 2600, 4096, torch.bfloat16, False, 132, d=14336).k_split == 4
    assert P(1, 1301, 4096, torch.bfloat16, False, 132, d=14336).k_split == 4


def test_plan_o_split():
    P = plan.plan_launch
    p = P(1, 1301, 4096, torch.bfloat16, False, 132, d=14336)  # split-K: the gate reads scores
    assert p.k_split > 1 and p.o_split > 1 and p.o_per_split % 256 == 0
    assert p.o_per_split * p.o_split >= 4096 > p.o_per_split * (p.o_split - 1)
    assert p.split * p.o_split >= 2 * 132
    assert P(1, 10000, 4096, torch.bfloat16, False, 132, d=14336).o_split == 1  # reads h: one slice
    assert P(2048, 1301, 4096, torch.bfloat16, False, 132).o_split == 1  # phase B of a prefill: enough programs
    assert P(1, 10000, 4096, torch.bfloat16, False, 132).o_split > 1  # phase B of decode
    assert P(64, 300, 4096, torch.bfloat16, False, 132, d=14336).o_split == 1  # more than 32 tokens
    p = P(1, 50, 24, torch.float32, False, 1, d=80, k_split=2, o_split=5)
    assert (p.o_split, p.o_per_split) == (5, 5)
    assert P(1, 50, 24, torch.float32, False, 1, d=80, o_split=5).o_split == 1  # d not split: o_split ignored


def test_broken_split_kernels_raise_instead_of_falling_back(monkeypatch):
    """Triton importable but the split kernels not: a clear error, never the host-syncing fallback."""
    import sys

    import aloe_kernels.ops
    from aloe_kernels import tensor_parallel as dispatch

    monkeypatch.delattr(aloe_kernels.ops, "tensor_parallel")
    monkeypatch.setitem(sys.modules, "aloe_kernels.ops.tensor_parallel", None)  # import fails
    dispatch._split_kernels.cache_clear()
    h, addresses = torch.randn(3, D), torch.randn(5, D)
    try:
        with pytest.raises(RuntimeError, match="tensor-parallel Triton kernels do not import"):
            dispatch.partial_scores(h, addresses)
        with pytest.raises(RuntimeError, match="tensor-parallel Triton kernels do not import"):
            dispatch.apply_from_scores_(
                torch.zeros(3, D_OUT), torch.randn(3, 6), torch.zeros(5), torch.ones(5), torch.randn(5, D_OUT), 1e-6, 1e-3
            )
    finally:
        dispatch._split_kernels.cache_clear()


def test_autotuning_never_starts_during_graph_capture(monkeypatch):
    """A key first met while a CUDA graph is captured takes the fixed blocks (a warning says so);
    one tuned before capture keeps its tuned kernel; outside capture every key may tune."""
    from aloe_kernels.ops import launch_plan

    monkeypatch.setattr(launch_plan, "_AUTOTUNED", set())
    cuda = torch.device("cuda")
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    assert launch_plan.may_autotune(("warm",), cuda)  # eager warm-up tunes it
    capturing[0] = True
    assert launch_plan.may_autotune(("warm",), cuda)
    with pytest.warns(RuntimeWarning, match="first met during CUDA-graph capture"):
        assert not launch_plan.may_autotune(("cold",), cuda)
    capturing[0] = False
    assert launch_plan.may_autotune(("cold",), cuda)
    assert launch_plan.may_autotune(("cpu",), torch.device("cpu"))
    monkeypatch.setenv("ALOE_KERNEL_AUTOTUNE", "0")  # fixed blocks everywhere, no startup benchmarking
    assert not launch_plan.may_autotune(("new",), cuda) and not launch_plan.may_autotune(("warm",), cuda)


def test_cuda_without_triton_is_an_error_naming_the_cause(monkeypatch):
    """No silent PyTorch fallback on CUDA (it syncs the host and cannot be graph-captured)."""
    from types import SimpleNamespace

    from aloe_kernels import runtime

    monkeypatch.setattr(runtime, "_triton_import_error", lambda: "ImportError: No module named 'triton'")
    with pytest.raises(RuntimeError, match="Triton does not import \\(ImportError: No module named 'triton'\\)"):
        runtime.use_fused_kernel(SimpleNamespace(is_cuda=True))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert runtime.use_fused_kernel(SimpleNamespace(is_cuda=False)) is False  # CPU keeps its PyTorch path
