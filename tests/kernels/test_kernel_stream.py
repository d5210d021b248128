"""The streaming decode kernels (S + W, ``ALOE_DECODE_KERNEL=stream``) under the Triton interpreter.

Every result is compared with a float64 evaluation of the ALOE formula on the same (rounded)
inputs (``ref_delta`` of test_kernel). Workspaces are poisoned (NaN, or 1 in int buffers), so a
read of an element the kernels did not write shows up. Shapes are ragged: d and d_out are not
multiples of the blocks, edit counts leave partial edit blocks, and the persistent programs'
step ranges cut edit blocks in the middle.
"""

import math

import pytest
import torch
from test_kernel import (  # noqa: F401  (pytestmark applies to this module too)
    FP32_TOL,
    HALF_TOL,
    cast_op,
    gate,
    make_case,
    pytestmark,
    ref_delta,
    rel_err,
)

stream = pytest.importorskip("aloe_kernels.ops.stream_gate")
buffers = pytest.importorskip("aloe_kernels.ops.buffers")


@pytest.fixture(autouse=True)
def poisoned_workspaces(monkeypatch):
    real = buffers.empty_workspace

    def poisoned(shape, device, dtype):
        t = real(shape, device, dtype)
        return t.fill_(float("nan") if dtype.is_floating_point else 1)

    monkeypatch.setattr(buffers, "empty_workspace", poisoned)


def run(y, h, op, programs=0, order=None, screen=None, **blocks):
    stream.run_stream_gate(
        y.view(-1, op.d_out),
        h.reshape(-1, op.d),
        op.addresses,
        op.thresholds,
        op.temperatures,
        op.writes,
        op.eps,
        op.gate_eps,
        programs=programs,
        program_order=order,
        screen=screen,
        blocks_given=tuple(blocks.get(k, 0) for k in ("block_t", "block_n", "block_d", "block_o")),
    )
    return y


def fused(y, h, op, **kw):
    """The public entry point (which dispatches on ALOE_DECODE_KERNEL)."""
    args = (op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps)
    gate.aloe_gate_residual_(y, h, *args, **kw)
    return y


def counters_zero():
    """Every ticket counter of the test device is back at 0 (the kernels reset them in-kernel)."""
    device = torch.empty(0).device  # the test device (conftest sets the default device on a GPU run)
    found = [c for dev, c in buffers._COUNTERS.items() if dev.type == device.type]
    assert found, f"no ticket counters were allocated on {device}"
    return all(bool((c == 0).all()) for c in found)


# (T, n, d, d_out, programs): one edit, one token, more programs than steps, ragged everything.
CASES = [
    (1, 1, 48, 24, 1),
    (1, 1, 80, 24, 9),
    (1, 50, 80, 24, 4),
    (1, 300, 33, 17, 7),
    (7, 37, 80, 24, 5),
    (16, 20, 33, 17, 3),
    (32, 100, 80, 40, 6),
]


@pytest.mark.parametrize("T,n,d,d_out,programs", CASES)
def test_fp32_mixed_matches_float64(T, n, d, d_out, programs):
    h, op = make_case(T, d, d_out, n, "mixed", seed=T * 13 + n)
    ref, g = ref_delta(h, op)
    if T * n > 1:
        assert (g > 0).any() and (g == 0).any(), "the case should open some gates, not all"
    y = torch.full((T, d_out), 0.25)
    run(y, h, op, programs)
    assert rel_err(y.double() - 0.25, ref) <= FP32_TOL
    assert counters_zero(), "every ticket counter is put back to 0 in-kernel"


def test_zero_and_huge_rows():
    T, d, d_out, n = 6, 80, 24, 40
    h, op = make_case(T, d, d_out, n, "mixed", seed=5, zero_rows=(1,))
    h[2] *= 1e30  # squares overflow fp32: the norm is summed in float64
    h[4] = -h[4] * 1e30
    ref, g = ref_delta(h, op)
    assert (g[2] > 0).any() or (g[4] > 0).any()
    y = torch.zeros(T, d_out)
    run(y, h, op, programs=5)
    assert torch.isfinite(y).all()
    assert rel_err(y, ref) <= FP32_TOL


def test_all_closed_leaves_y_bits():
    T, d, d_out, n = 5, 80, 24, 60
    h, op = make_case(T, d, d_out, n, "closed", seed=2)
    y = torch.randn(T, d_out)
    before = y.clone()
    run(y, h, op, programs=4)
    assert torch.equal(y, before)


def test_rows_without_open_gates_keep_their_bits():
    T, d, d_out, n = 8, 48, 24, 30
    h, op = make_case(T, d, d_out, n, "closed", seed=11)
    # Edit 3 opens on the token it scores highest only: its open floor halfway to the runner-up.
    s = torch.nn.functional.normalize(h.double(), dim=1) @ op.addresses.double().T
    top2 = s[:, 3].topk(2).values
    logit = math.log(op.gate_eps / (1 - op.gate_eps))
    op.thresholds[3] = float(top2.mean() - logit / op.temperatures[3].double())
    _, g = ref_delta(h, op)
    closed = (g == 0).all(dim=1)
    assert closed.any() and not closed.all()
    y = torch.randn(T, d_out)
    before = y.clone()
    run(y, h, op, programs=3)
    assert torch.equal(y[closed], before[closed])


@pytest.mark.parametrize("T,n", [(1, 3), (9, 70)])
def test_all_open(T, n):
    h, op = make_case(T, 80, 24, n, "open", seed=3)
    ref, g = ref_delta(h, op)
    assert bool((g > 0.99).all())
    y = torch.zeros(T, 24)
    run(y, h, op, programs=6)
    assert rel_err(y, ref) <= FP32_TOL


@pytest.mark.parametrize(
    "dtype,ydtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32), (torch.bfloat16, torch.float32)]
)
def test_half_inputs(dtype, ydtype):
    T, d, d_out, n = 4, 80, 24, 45
    h, op = make_case(T, d, d_out, n, "mixed", seed=21)
    h, op = h.to(dtype), cast_op(op, dtype)
    ref, _ = ref_delta(h, op)
    y = torch.zeros(T, d_out, dtype=ydtype)
    run(y, h, op, programs=5)
    assert rel_err(y, ref) <= HALF_TOL


def test_program_order_does_not_change_bits():
    """Whichever program takes an edit block's last ticket, the block's segments are summed in order."""
    T, d, d_out, n, programs = 3, 80, 24, 70, 7
    h, op = make_case(T, d, d_out, n, "mixed", seed=8)
    base = run(torch.zeros(T, d_out), h, op, programs)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        order = torch.randperm(programs, generator=gen).to(torch.int32)
        out = run(torch.zeros(T, d_out), h, op, programs, order)
        assert torch.equal(out, base), f"order {order.tolist()}"
    assert counters_zero()


def test_env_selects_the_stream_for_decode_only(monkeypatch):
    T, d, d_out, n = 5, 80, 24, 33
    h, op = make_case(T, d, d_out, n, "mixed", seed=4)
    direct = run(torch.zeros(T, d_out), h, op, programs=3)
    launched = []
    real = stream.run_stream_gate
    monkeypatch.setattr(gate, "run_stream_gate", lambda *a, **k: (launched.append(a[0].shape[0]), real(*a, **k)))
    monkeypatch.setenv("ALOE_DECODE_KERNEL", "stream")
    y = fused(torch.zeros(T, d_out), h, op, split=3, block_n=16, block_d=32, block_o=16)
    assert launched == [T] and torch.equal(y, direct)
    # 33 tokens: prefill, the split path, still right.
    h2, op2 = make_case(33, d, d_out, n, "mixed", seed=6)
    y2 = fused(torch.zeros(33, d_out), h2, op2, block_t=16, block_n=16, block_d=16, block_o=16)
    assert launched == [T]
    assert rel_err(y2, ref_delta(h2, op2)[0]) <= FP32_TOL


def test_bad_choice_is_named(monkeypatch):
    monkeypatch.setenv("ALOE_DECODE_KERNEL", "fast")
    with pytest.raises(ValueError, match="split, stream"):
        stream.decode_kernel()


def test_two_launches_per_call(monkeypatch):
    kernels = stream.jit_stream_kernels(stream.triton_interpreting())
    calls = []
    for name in ("scores", "write"):
        real = kernels[name]

        class Counting:
            def __init__(self, fn, name):
                self.fn, self.name = fn, name

            def __getitem__(self, grid):
                calls.append(self.name)
                return self.fn[grid]

        monkeypatch.setitem(kernels, name, Counting(real, name))
    T, d, d_out, n = 2, 48, 24, 20
    h, op = make_case(T, d, d_out, n, "mixed", seed=1)
    y = run(torch.zeros(T, d_out), h, op, programs=2)
    assert calls == ["scores", "write"]
    assert rel_err(y, ref_delta(h, op)[0]) <= FP32_TOL


# ------------------------------------------------------------- int8 screen
def _screened(h, op, q, programs, order=None):
    limits = q.screen_limits(op.addresses, op.thresholds, op.temperatures, op.gate_eps)
    return run(torch.zeros(h.shape[0], op.d_out), h, op, programs, order, screen=(q.values, q.scales, limits))


@pytest.mark.parametrize(
    "T,n,d,programs,dtype",
    [
        (1, 1, 130, 1, torch.float32),
        (3, 40, 300, 4, torch.float32),
        (9, 70, 257, 6, torch.float32),
        (5, 50, 300, 3, torch.bfloat16),
    ],
)
def test_int8_screen_gives_the_plain_bits(T, n, d, programs, dtype):
    """The int8 pass keeps every edit that opens; the rescoring pass reproduces the plain call's bits."""
    from aloe_kernels.int8_addresses import Int8Addresses

    h, op = make_case(T, d, 24, n, "mixed", seed=T * 5 + n)
    op = op.to(dtype=torch.float32)
    # Built addresses have norms of about 100 (the screen's error grows with them); the same gates.
    op.addresses.mul_(120.0)
    op.thresholds.mul_(120.0)
    op.temperatures.div_(120.0)
    h, op = h.to(dtype), op.to(dtype=dtype)
    q = Int8Addresses.quantize(op.addresses)
    ref, g = ref_delta(h, op)
    plain = run(torch.zeros(T, 24), h, op, programs)
    got = _screened(h, op, q, programs)
    assert torch.equal(got, plain)
    assert rel_err(got, ref) <= (FP32_TOL if dtype == torch.float32 else HALF_TOL)
    units = torch.nn.functional.normalize(h.double(), dim=1).float()
    kept = q.may_open(units, op.addresses, op.thresholds, op.temperatures, op.gate_eps).any(dim=0)
    if n > 1:
        assert 0 < int(kept.sum()) < n, "the case should let the screen drop some edits"
    assert counters_zero()


def test_int8_screen_kept_rows_only_are_read(monkeypatch):
    """The rescoring pass reads no address row the screen dropped: poison them, the result stays."""
    from aloe_kernels.int8_addresses import Int8Addresses

    T, n, d = 4, 60, 300
    h, op = make_case(T, d, 24, n, "closed", seed=77)
    for e in (3, 40):  # two edits open on their best token; the others stay shut
        best = float((torch.nn.functional.normalize(h.double(), dim=1) @ op.addresses[e].double()).max())
        op.thresholds[e] = best - 0.01
    q = Int8Addresses.quantize(op.addresses)
    units = torch.nn.functional.normalize(h.double(), dim=1).float()
    kept = q.may_open(units, op.addresses, op.thresholds, op.temperatures, op.gate_eps).any(dim=0)
    assert 0 < int(kept.sum()) < n
    blocks = torch.nn.functional.pad(kept, (0, -n % 16)).view(-1, 16).any(dim=1)  # the interpreter's 16-edit blocks
    assert blocks.any() and not blocks.all(), "some edit block should hold no kept edit (it is never rescored)"
    want = _screened(h, op, q, programs=5)
    op.addresses[~kept] = float("nan")
    assert torch.equal(_screened(h, op, q, programs=5), want)


def test_int8_screen_adversarial_state_is_kept():
    """A state along an edit's quantisation error, with the floor between its screen and exact scores."""
    import math

    from aloe_kernels.int8_addresses import Int8Addresses

    T, n, d = 2, 30, 300
    h, op = make_case(T, d, 24, n, "closed", seed=9)
    q = Int8Addresses.quantize(op.addresses)
    err = (op.addresses[4].double() - q.dequantized()[4].double()).float()
    h = torch.cat([h, (err / err.norm())[None] + 0.0 * h[:1]])
    u = torch.nn.functional.normalize(h[-1].double(), dim=0)
    exact, screen = float(u @ op.addresses[4].double()), float(u @ q.dequantized()[4].double())
    assert exact - screen > 0.9 * float(q.error_norms[4])
    logit = math.log(op.gate_eps / (1 - op.gate_eps))
    op.thresholds[4] = float((exact + screen) / 2 - logit / float(op.temperatures[4]))
    ref, g = ref_delta(h, op)
    assert bool(g[-1, 4] > 0)  # open only because of the error: its screen score is below the floor
    got = _screened(h, op, q, programs=3)
    assert torch.equal(got, run(torch.zeros(T + 1, 24), h, op, 3))
    assert rel_err(got, ref) <= FP32_TOL


# ------------------------------------------------------------- the HF module with int8 addresses
def test_hf_module_with_int8_addresses_gives_the_stream_bits(monkeypatch):
    """``apply_aloe(int8_addresses=True)``: decode-sized calls take the screened path, with the bits of
    the plain streaming kernel; longer calls take the usual path."""
    from helpers import operator_opening_on
    from tiny_models import tiny_model

    from aloe_kernels import apply_aloe, remove_aloe, weight_fingerprint
    from aloe_kernels.hf import locate_down_proj

    model = tiny_model("llama")
    site = locate_down_proj(model, 1)
    seen = {}
    hook = site.module.register_forward_hook(lambda m, a, o: seen.update(h=a[0].detach().clone()))
    ids = torch.randint(5, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    hook.remove()
    rows = seen["h"].reshape(-1, site.d)[:3]
    base = operator_opening_on(rows, n_extra=40, d_out=site.d_out)
    op = type(base)(
        **{k: getattr(base, k) for k in ("addresses", "thresholds", "temperatures", "writes")},
        layer=1,
        weight_fingerprint=weight_fingerprint(site.weight()),
    )
    monkeypatch.setenv("ALOE_DECODE_KERNEL", "stream")
    screened = []
    real = stream.aloe_stream_screened_residual_
    monkeypatch.setattr(stream, "aloe_stream_screened_residual_", lambda y, h, *a: (screened.append(h.shape), real(y, h, *a))[1])
    logits = {}
    for int8 in (False, True):
        wrapper = apply_aloe(model, op, int8_addresses=int8, write_positions="all")
        assert (wrapper._stream_screen is not None) == int8
        with torch.no_grad():
            logits[int8] = (model(input_ids=ids).logits, model(input_ids=torch.cat([ids, ids], dim=1)).logits)
        remove_aloe(model)
    assert screened == [torch.Size([2, 12, site.d])], "only the 24-token call takes the screened path"
    assert torch.equal(logits[True][0], logits[False][0])  # 24 tokens: the screened decode path
    assert torch.equal(logits[True][1], logits[False][1])  # 48 tokens: the usual path for both
    with torch.no_grad():
        plain = model(input_ids=ids).logits
    assert not torch.allclose(plain, logits[True][0]), "the operator should change the outputs"


def test_screened_custom_op_opcheck():
    from aloe_kernels.int8_addresses import Int8Addresses

    h, op = make_case(5, 300, 24, 40, "mixed", seed=31)
    q = Int8Addresses.quantize(op.addresses)
    limits = q.screen_limits(op.addresses, op.thresholds, op.temperatures, op.gate_eps)
    args = (torch.zeros(5, 24), h, op.addresses, op.thresholds, op.temperatures, op.writes, q.values, q.scales, limits)
    torch.library.opcheck(
        torch.ops.aloe.stream_gate_screened_.default, (*args, op.eps, op.gate_eps), test_utils=("test_schema", "test_faketensor")
    )
