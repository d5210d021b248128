"""``graph`` part: CUDA-graph capture and ``torch.compile(fullgraph=True)`` of
``aloe_residual_`` and of the HF-patched down-projection, against float64.

Every result is compared with the float64 formula on the same rounded inputs
(:func:`benchmarks.gpu.common.float64_delta`). A graph replay is checked with a
new ``h`` copied into the captured buffer, so a replay that reused stale inputs
would fail. On CPU (smoke) CUDA graphs are skipped and compile uses aot_eager.
"""

from __future__ import annotations

from typing import Callable

import torch

from .common import Context, PartResult, float64_delta, rel_err

TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-4}


def _check(res: PartResult, name: str, got: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = rel_err(got, ref)
    ok = err <= tol and bool(torch.isfinite(got).all())
    res.data.setdefault("checks", []).append({"check": name, "rel_err": err, "tol": tol, "ok": ok})
    res.log(f"{'PASS' if ok else 'FAIL'} {name}: rel_err={err:.2e} (tol {tol:.0e})")
    if not ok:
        res.status = "fail"


def _attempt(res: PartResult, name: str, fn: Callable[[], None]) -> None:
    """Run one check; an exception fails that check and the part, not the suite."""
    try:
        fn()
    except Exception as exc:
        res.status = "fail"
        res.data.setdefault("checks", []).append({"check": name, "ok": False, "error": repr(exc)[:500]})
        res.log(f"FAIL {name}: {type(exc).__name__}: {str(exc)[:300]}")


def _graph_replay(fn: Callable[[], object], inputs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Capture ``fn`` once, then copy new values into the captured buffers and replay."""
    from .timing import GraphTimer

    graph = GraphTimer(flush=False).capture(fn)
    for buf, new in inputs:
        buf.copy_(new)
    graph.replay()
    torch.cuda.synchronize()


def _compile_modes(ctx: Context) -> list[tuple[str, dict]]:
    if ctx.cuda:
        return [("default", {"mode": "default"}), ("reduce-overhead", {"mode": "reduce-overhead"})]
    return [("aot_eager", {"backend": "aot_eager"})]  # inductor on CPU costs minutes of C++ compile


def check_residual(ctx: Context, res: PartResult, dtype: torch.dtype) -> None:
    """``aloe_residual_`` eager, replayed from a CUDA graph with a new h, and compiled fullgraph."""
    from aloe_kernels import aloe_residual_
    from benchmarks.gate.bench_gate import SHAPES, make_workload

    shape, T, n = ("llama3-8b", 4, 10000) if ctx.cuda else ("tiny", 3, 50)
    w = make_workload(shape, T, n, "1", dtype, ctx.device, seed=11, gen_device=ctx.device)
    h_new = (w.h.flip(0) * 1.7).contiguous()  # the planted tokens in another order, other norms: new outputs
    op, d_out, tol = w.op, SHAPES[shape][1], TOL[dtype]
    res.data["residual_case"] = {"shape": shape, "T": T, "n": n, "open_per_token": w.measured_active}
    ref = float64_delta(w.h, op)

    y = torch.zeros(T, d_out, device=ctx.device, dtype=dtype)
    aloe_residual_(y, w.h, op)
    _check(res, f"aloe_residual_ eager T={T} n={n}", y, ref, tol)
    if ctx.cuda:
        h = w.h.clone()
        y = torch.zeros(T, d_out, device="cuda", dtype=dtype)

        def replay():
            _graph_replay(lambda: aloe_residual_(y.zero_(), h, op), [(h, h_new)])
            _check(res, "aloe_residual_ CUDA graph replay with a new h", y, float64_delta(h_new, op), tol)

        _attempt(res, "aloe_residual_ CUDA graph", replay)
    else:
        res.log("SKIP CUDA graph capture of aloe_residual_: needs CUDA")

    def f(base: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = base.clone()
        aloe_residual_(y, x, op)
        return y

    for label, kw in _compile_modes(ctx):

        def compiled(label=label, kw=kw):
            torch._dynamo.reset()
            cf = torch.compile(f, fullgraph=True, **kw)
            for x in (w.h, h_new, w.h):  # reduce-overhead records a graph on the 2nd/3rd call
                out = cf(torch.zeros(T, d_out, device=ctx.device, dtype=dtype), x)
            _check(res, f"aloe_residual_ torch.compile fullgraph {label}", out, ref, tol)

        _attempt(res, f"aloe_residual_ torch.compile {label}", compiled)


STREAM_REPLAYS = 200


def check_stream_replays(ctx: Context, res: PartResult, dtype: torch.dtype) -> None:
    """The streaming decode kernels (S + W) captured once, replayed 200 times: identical bits every time."""
    from aloe_kernels.ops import buffers
    from aloe_kernels.ops.stream_gate import run_stream_gate
    from benchmarks.gate.bench_gate import make_workload

    from .timing import GraphTimer

    w = make_workload("llama3-8b", 1, 10000, "1", dtype, "cuda", seed=12, gen_device="cuda")
    op, y = w.op, torch.zeros(1, w.d_out, device="cuda", dtype=dtype)
    args = (w.h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps)
    run_stream_gate(y, *args)  # eager first: the ticket counters are allocated outside capture
    _check(res, "stream S + W eager T=1 n=10000", y, float64_delta(w.h, op), TOL[dtype])
    graph = GraphTimer(flush=False).capture(lambda: run_stream_gate(y.zero_(), *args))
    graph.replay()
    torch.cuda.synchronize()
    first = y.clone()
    same = 0
    for _ in range(STREAM_REPLAYS):
        graph.replay()
        torch.cuda.synchronize()
        same += int(torch.equal(y, first))
    zero = bool((buffers.ticket_counters(y.device, 1) == 0).all())
    ok = same == STREAM_REPLAYS and zero
    res.data.setdefault("checks", []).append(
        {
            "check": "stream CUDA-graph replays bit-identical",
            "ok": ok,
            "identical": same,
            "replays": STREAM_REPLAYS,
            "counters_zero": zero,
        }
    )
    res.log(f"{'PASS' if ok else 'FAIL'} stream CUDA-graph replays: {same}/{STREAM_REPLAYS} identical, counters zero: {zero}")
    if not ok:
        res.status = "fail"
    _check(res, "stream CUDA-graph replay", first, float64_delta(w.h, op), TOL[dtype])


def _tiny_or_llama_mlp(ctx: Context, dtype: torch.dtype):
    """A one-layer random Llama whose MLP has the Llama-3-8B down-projection shape (CPU: tiny)."""
    import transformers

    hidden, inter = (4096, 14336) if ctx.cuda else (24, 48)
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=1,
        num_attention_heads=max(1, hidden // 128),
        num_key_value_heads=1,
        head_dim=min(128, hidden),
        vocab_size=256,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


def check_hf_patch(ctx: Context, res: PartResult, dtype: torch.dtype) -> None:
    """The patched down-projection module (``apply_aloe``): eager, CUDA graph and compiled fullgraph."""
    from aloe_kernels import AloeOperator, apply_aloe
    from aloe_kernels.hf import locate_down_proj

    model = _tiny_or_llama_mlp(ctx, dtype)
    site = locate_down_proj(model, 0)
    seen: dict = {}
    hook = site.module.register_forward_hook(lambda m, a, o: seen.update(h=a[0].detach().clone()))
    with torch.no_grad():
        model(torch.arange(10, device=ctx.device).reshape(2, 5))
    hook.remove()
    h = seen["h"]  # (2, 5, d): the down-projection's real inputs
    rows = h.reshape(-1, site.d).float()
    n_extra = 200 if ctx.cuda else 20
    gen = torch.Generator(device=ctx.device).manual_seed(3)
    extra = torch.randn(n_extra, site.d, generator=gen, device=ctx.device)
    addresses = torch.nn.functional.normalize(torch.cat([rows[:3], extra]), dim=1)  # 3 edits open on 3 tokens
    n = addresses.shape[0]
    writes = torch.randn(n, site.d_out, generator=gen, device=ctx.device) * float(rows.abs().max())
    op = AloeOperator(
        addresses=addresses,
        thresholds=torch.full((n,), 0.8, device=ctx.device),
        temperatures=torch.full((n,), 30.0, device=ctx.device),
        writes=writes,
        layer=0,
    )
    wrapper = apply_aloe(model, op, write_positions="all")  # the operator's math at every position
    op_rt = wrapper.operator  # as held by the module (weight dtype on GPU, float32 on CPU)
    with torch.no_grad():
        base = site.module(h)
        ref = base.double() + float64_delta(h, op_rt)
        _check(res, f"HF patched down_proj eager ({dtype}, n={n})", wrapper(h), ref, TOL[dtype])
        wrapper.write_positions = "generated"  # the default: each row's last position only
        ref_last = torch.cat([base.double()[:, :-1], ref[:, -1:]], dim=1)
        _check(res, "HF patched down_proj eager, write_positions=generated", wrapper(h), ref_last, TOL[dtype])
        wrapper.write_positions = "all"
        if ctx.cuda:
            x = torch.zeros_like(h)  # captured on zeros: the replay must read the h copied in afterwards
            out: dict = {}

            def replay():
                _graph_replay(lambda: out.update(y=wrapper(x)), [(x, h)])
                _check(res, "HF patched down_proj CUDA graph replay", out["y"], ref, TOL[dtype])

            _attempt(res, "HF patched down_proj CUDA graph", replay)
        else:
            res.log("SKIP CUDA graph capture of the patched down_proj: needs CUDA")
        for label, kw in _compile_modes(ctx):

            def compiled(label=label, kw=kw):
                torch._dynamo.reset()
                cm = torch.compile(wrapper, fullgraph=True, **kw)
                for _ in range(3):
                    got = cm(h)
                _check(res, f"HF patched down_proj torch.compile fullgraph {label}", got, ref, TOL[dtype])

            _attempt(res, f"HF patched down_proj torch.compile {label}", compiled)


def run(ctx: Context) -> PartResult:
    """The ``graph`` part."""
    res = PartResult("graph")
    dtype = torch.bfloat16 if ctx.cuda else torch.float32
    _attempt(res, "aloe_residual_ checks", lambda: check_residual(ctx, res, dtype))
    _attempt(res, "HF patch checks", lambda: check_hf_patch(ctx, res, dtype))
    if ctx.cuda:
        _attempt(res, "stream replays", lambda: check_stream_replays(ctx, res, dtype))
    else:
        res.log("SKIP stream CUDA-graph replays: needs CUDA")
    checks = res.data.get("checks", [])
    worst = max((c.get("rel_err", 0.0) for c in checks), default=float("nan"))
    res.data["summary"] = f"{sum(c['ok'] for c in checks)}/{len(checks)} checks pass; worst rel_err vs float64 {worst:.1e}"
    return res
