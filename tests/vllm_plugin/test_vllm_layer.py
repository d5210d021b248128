"""``AloeRowParallelLinear`` against the installed vLLM's own ``RowParallelLinear``, in this process.

- The constructor keywords the plugin passes are exactly the installed signature's.
- With every slot inert, the layer's output equals the stock layer's bit for bit (the copied
  forward still matches vLLM's), on every CPU path.
- A swap whose writes fail leaves the previous operator live, bit for bit.
- Every ``torch.ops.aloe_vllm`` op passes ``torch.library.opcheck``.

One rank (gloo), initialised once for the module and torn down after it.
"""

from __future__ import annotations

import dataclasses
import inspect
import socket

import pytest
import torch

pytestmark = pytest.mark.vllm  # make test-vllm runs these in .venv-vllm
pytest.importorskip("vllm")

from helpers import random_operator  # noqa: E402

from aloe_kernels import AloeOperator, aloe_reference  # noqa: E402
from aloe_vllm.format import INERT, AloeSpec, AloeSwapFailed  # noqa: E402

D, D_OUT, SLOTS = 96, 40, 7
PREFIX = "model.layers.1.mlp.down_proj"


@pytest.fixture(scope="module")
def vllm_rank():
    """vLLM's distributed state for one rank, and the config context layers are built in."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import cleanup_dist_env_and_memory, init_distributed_environment, initialize_model_parallel

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo"
        )
        initialize_model_parallel(1, 1)
        try:
            yield
        finally:
            cleanup_dist_env_and_memory()


def _layers(weight: torch.Tensor, spec: AloeSpec, screen: str, monkeypatch):
    """The stock down-projection and the ALOE layer built from it, both holding ``weight``."""
    from vllm.model_executor.layers.linear import RowParallelLinear

    from aloe_vllm.layer import AloeRowParallelLinear
    from aloe_vllm.models import layer_keywords

    # "kernel": the fused Triton kernel (in its interpreter); otherwise the CPU serving paths.
    monkeypatch.setenv("TRITON_INTERPRET", "1" if screen == "kernel" else "0")
    monkeypatch.setenv("ALOE_VLLM_SCREEN", "0" if screen == "kernel" else screen)
    stock = RowParallelLinear(D, D_OUT, bias=False, params_dtype=torch.float32, prefix=PREFIX, return_bias=False)
    aloe = AloeRowParallelLinear(D, D_OUT, spec=spec, **layer_keywords(stock))
    for layer in (stock, aloe):
        layer.weight.data.copy_(weight)
        layer.quant_method.process_weights_after_loading(layer)
    aloe.aloe_finalize()
    return stock, aloe


def _spec(n: int = 0) -> AloeSpec:
    return AloeSpec(layer=1, n=n, d=D, d_out=D_OUT, eps=1e-6, gate_eps=1e-3, capacity=SLOTS)


def _inputs() -> list[torch.Tensor]:
    """T=1, a ragged batch, a zero row and rows of +-1e30 (every gate of an inert slot must stay 0)."""
    big = torch.randn(3, D)
    big[0] = 0.0
    big[1:] *= 1e30
    return [torch.randn(1, D), torch.randn(33, D), big]


def test_constructor_keywords_match_installed_vllm(vllm_rank):
    from vllm.model_executor.layers.linear import RowParallelLinear

    from aloe_vllm.models import layer_keywords

    stock = RowParallelLinear(D, D_OUT, bias=False, params_dtype=torch.float32, prefix=PREFIX, return_bias=False)
    installed = set(inspect.signature(RowParallelLinear.__init__).parameters) - {"self", "input_size", "output_size"}
    assert set(layer_keywords(stock)) == installed


@pytest.mark.parametrize("screen", ["0", "bf16", "int8", "kernel"])
def test_inert_layer_equals_stock_layer_bitwise(vllm_rank, screen, monkeypatch):
    """No live edit (active 0), then every slot live but inert: the output is the stock layer's."""
    from aloe_vllm.screen import int8_screen_supported

    if screen == "int8" and not int8_screen_supported():
        pytest.skip("this PyTorch has no int8 linear on CPU")
    stock, aloe = _layers(torch.randn(D_OUT, D), _spec(0), screen, monkeypatch)
    inert = AloeOperator(
        addresses=torch.full((SLOTS, D), INERT["addresses"]),
        thresholds=torch.full((SLOTS,), INERT["thresholds"]),
        temperatures=torch.full((SLOTS,), INERT["temperatures"]),
        writes=torch.full((SLOTS, D_OUT), INERT["writes"]),
        eps=1e-6,
        gate_eps=1e-3,
    )
    for state in ("no live edit", "every slot inert"):
        if state == "every slot inert":
            aloe.aloe_swap_(inert, "inert")
            assert aloe.aloe_active_n == SLOTS
        for x in _inputs():
            assert torch.equal(aloe(x), stock(x)), (state, x.shape)


@pytest.mark.parametrize("fail_in", ["aloe_writes", "screen"])
def test_failed_swap_restores_previous_operator(vllm_rank, fail_in, monkeypatch):
    """A write that fails midway: AloeSwapFailed, and the previous operator serves bit for bit."""
    stock, aloe = _layers(torch.randn(D_OUT, D), _spec(0), "bf16", monkeypatch)
    assert aloe.aloe_screen == "bf16"
    h = torch.randn(9, D)
    a = random_operator(4, D, D_OUT)
    a.addresses[:2] = torch.nn.functional.normalize(h[:2], dim=1)  # two edits open on the probes
    a.thresholds[:2] = 0.8
    b = dataclasses.replace(random_operator(SLOTS, D, D_OUT, seed=1), eps=a.eps, gate_eps=a.gate_eps)
    aloe.aloe_swap_(a, "hash-a")
    before = aloe(h)
    torch.testing.assert_close(before - stock(h), aloe_reference(h, a), atol=1e-5, rtol=1e-5)
    params = {name: getattr(aloe, name).detach().clone() for name in ("aloe_addresses", "aloe_writes", "aloe_thresholds")}
    info = aloe.aloe_info()

    def broken(*args, **kwargs):
        raise RuntimeError("injected write failure")

    if fail_in == "screen":
        real = aloe._aloe_refresh_screen
        calls = iter([broken, real])  # the swap's refresh fails, the restore's works
        monkeypatch.setattr(aloe, "_aloe_refresh_screen", lambda: next(calls)())
    else:
        real_place = aloe._place_rows
        monkeypatch.setattr(aloe, "_place_rows", lambda name, rows: broken() if name == fail_in else real_place(name, rows))
    with pytest.raises(AloeSwapFailed, match="previous operator hash-a is live again"):
        aloe.aloe_swap_(b, "hash-b")
    assert aloe.aloe_info() == info
    for name, want in params.items():
        assert torch.equal(getattr(aloe, name), want), name
    assert torch.equal(aloe(h), before)
    monkeypatch.undo()
    aloe.aloe_swap_(b, "hash-b")  # and the next swap goes through
    torch.testing.assert_close(aloe(h) - stock(h), aloe_reference(h, b), atol=1e-5, rtol=1e-5)


def test_custom_ops_pass_opcheck(monkeypatch):
    """Schemas, fake implementations and the mutation annotations of every aloe_vllm op."""
    import aloe_vllm.ops  # noqa: F401  (registers torch.ops.aloe_vllm)
    from aloe_vllm.screen import int8_screen_supported, refresh_int8_screen_, refresh_screen_, screen_buffers

    op = random_operator(5, D, D_OUT)
    h = torch.randn(6, D)
    op.addresses[:2] = torch.nn.functional.normalize(h[:2], dim=1)
    op.thresholds[:2] = 0.8
    fields = (op.addresses, op.thresholds, op.temperatures, op.writes)
    active = torch.tensor([op.n])
    ops = torch.ops.aloe_vllm
    torch.library.opcheck(ops.residual_, (torch.zeros(6, D_OUT), h, *fields, op.eps, op.gate_eps, active))
    torch.library.opcheck(ops.partial_scores, (h, op.addresses))
    scores = ops.partial_scores(h, op.addresses)
    torch.library.opcheck(ops.apply_from_scores_, (torch.zeros(6, D_OUT), scores, *fields[1:], op.eps, op.gate_eps, 0))
    bufs = screen_buffers(op.n, op.addresses, "bf16")
    refresh_screen_(bufs["aloe_addresses_lo"], bufs["aloe_screen_handle"], bufs["aloe_limit_lo"], *fields[:3], op.gate_eps, op.n)
    torch.library.opcheck(
        ops.screened_residual_,
        (torch.zeros(6, D_OUT), h, bufs["aloe_addresses_lo"], bufs["aloe_screen_handle"], bufs["aloe_limit_lo"], *fields)
        + (op.eps, op.gate_eps, active),
    )
    if int8_screen_supported():
        handle = screen_buffers(op.n, op.addresses, "int8")["aloe_screen_handle"]
        refresh_int8_screen_(handle, *fields[:3], op.gate_eps, op.n)
        torch.library.opcheck(
            ops.int8_screened_residual_, (torch.zeros(6, D_OUT), h, handle, *fields, op.eps, op.gate_eps, active)
        )
