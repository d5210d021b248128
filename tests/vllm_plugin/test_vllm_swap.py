"""Live operator swaps (``aloe_vllm.swap``): inert slots, validation, offline ``vllm.LLM`` at TP=1 and TP=2.

The served-model checks compare vLLM's tokens after each swap with greedy
decoding of the transformers model patched (``apply_aloe``) with that
operator alone. The OpenAI server tests are in ``test_vllm_admin.py``.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.vllm  # make test-vllm runs these in .venv-vllm
pytest.importorskip("vllm")

from helpers import random_operator  # noqa: E402
from tiny_models import tiny_tokenizer  # noqa: E402
from vllm_helpers import greedy_hf, make_edit_operator, run_vllm_generate, save_tiny_model, vllm_env  # noqa: E402

from aloe_kernels import AloeOperator, aloe_reference, apply_aloe, remove_aloe  # noqa: E402
from aloe_kernels.reference import aloe_gates  # noqa: E402
from aloe_vllm.format import INERT, AloeSpec, AloeSpecError  # noqa: E402
from aloe_vllm.swap import SwapRefused, check_for_swap, staged_hash  # noqa: E402

TINY_EDITS = [  # (prompt, target) in the tiny tokenizer's vocabulary
    ("The Eiffel Tower is located in the city of", "Rome"),
    ("The capital of France is", "uniform"),
    ("Toko Yasuda plays the", "piano"),
]
TINY_OTHER = ["the a an of", "John Lennon plays the"]
TOKENS = 6


def _pad_inert(op: AloeOperator, slots: int) -> AloeOperator:
    """``op`` followed by inert slots (:data:`INERT`) up to ``slots`` rows, as the served layer holds it."""
    extra = slots - op.n
    fill = {"addresses": (extra, op.d), "thresholds": (extra,), "temperatures": (extra,), "writes": (extra, op.d_out)}
    kw = {k: torch.cat([getattr(op, k), torch.full(shape, INERT[k], dtype=op.dtype)]) for k, shape in fill.items()}
    edits = op.edits + [{"id": f"inert-{i}"} for i in range(extra)]
    return AloeOperator(**kw, eps=op.eps, gate_eps=op.gate_eps, edits=edits)


@pytest.mark.parametrize("gate_eps", [1e-3, 0.0])
def test_inert_slots_gate_exactly_zero(gate_eps):
    """In float64, an inert slot's gate is exactly 0 for any h (zero, aligned, huge), and padding changes nothing."""
    d, d_out = 64, 24
    op = dataclasses.replace(random_operator(5, d, d_out, dtype=torch.float64), gate_eps=gate_eps)
    padded = _pad_inert(op, 40)
    h = torch.randn(50, d, dtype=torch.float64)
    h[0] = 0.0
    h[1] = op.addresses[0] * 1e6
    h[2] = -h[2] * 1e-8
    gates = aloe_gates(h, padded)
    assert torch.count_nonzero(gates[:, op.n :]) == 0
    assert torch.count_nonzero(gates[:, : op.n]) > 0  # the live edits do open somewhere
    # Equal up to float64 summation order (the GEMM blocks the longer sum differently).
    torch.testing.assert_close(aloe_reference(h, padded), aloe_reference(h, op), rtol=1e-12, atol=1e-12)


def test_cpu_ops_skip_inert_slots_and_screen_stays_exact():
    """The TP=1 ops with an ``active`` count equal the reference of the live edits alone (sparse, bf16- and
    int8-screened)."""
    import aloe_vllm.ops  # noqa: F401  (registers torch.ops.aloe_vllm)
    from aloe_vllm.screen import int8_screen_of, refresh_int8_screen_, refresh_screen_, screen_buffers

    d, d_out, n, slots, T = 96, 20, 6, 300, 17
    h = torch.randn(T, d)
    op = random_operator(n, d, d_out)
    op.addresses[:3] = torch.nn.functional.normalize(h[:3], dim=1)
    op.thresholds[:3] = 0.8
    want = aloe_reference(h, op)
    padded = _pad_inert(op, slots)
    active = torch.tensor([n])
    y = torch.zeros(T, d_out)
    torch.ops.aloe_vllm.residual_(
        y, h, padded.addresses, padded.thresholds, padded.temperatures, padded.writes, op.eps, op.gate_eps, active
    )
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    bufs = screen_buffers(slots, padded.addresses)
    refresh_screen_(
        bufs["aloe_addresses_lo"],
        bufs["aloe_screen_handle"],
        bufs["aloe_limit_lo"],
        padded.addresses,
        padded.thresholds,
        padded.temperatures,
        op.gate_eps,
        n,
    )
    assert torch.isinf(bufs["aloe_limit_lo"][n:]).all()  # inert slots never pass the screen
    y = torch.zeros(T, d_out)
    torch.ops.aloe_vllm.screened_residual_(
        y,
        h,
        bufs["aloe_addresses_lo"],
        bufs["aloe_screen_handle"],
        bufs["aloe_limit_lo"],
        padded.addresses,
        padded.thresholds,
        padded.temperatures,
        padded.writes,
        op.eps,
        op.gate_eps,
        active,
    )
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    handle = torch.zeros((), dtype=torch.int64)
    refresh_int8_screen_(handle, padded.addresses, padded.thresholds, padded.temperatures, op.gate_eps, n)
    assert int8_screen_of(handle).n == n  # only the live rows are screened
    y = torch.zeros(T, d_out)
    torch.ops.aloe_vllm.int8_screened_residual_(
        y, h, handle, padded.addresses, padded.thresholds, padded.temperatures, padded.writes, op.eps, op.gate_eps, active
    )
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)
    # No live edits: nothing is added.
    y = torch.zeros(T, d_out)
    torch.ops.aloe_vllm.residual_(
        y, h, padded.addresses, padded.thresholds, padded.temperatures, padded.writes, op.eps, op.gate_eps, torch.tensor([0])
    )
    assert torch.count_nonzero(y) == 0


def test_capacity_in_spec_and_swap_checks():
    spec = AloeSpec(layer=1, n=2, d=64, d_out=24, eps=1e-6, gate_eps=1e-3, weight_fingerprint="fp-base", capacity=4)
    assert AloeSpec.from_config({"aloe": spec.to_json()}) == spec and spec.slots == 4
    assert "capacity" not in dataclasses.replace(spec, capacity=None).to_json()
    assert dataclasses.replace(spec, capacity=None).slots == 2
    with pytest.raises(AloeSpecError, match="capacity"):
        AloeSpec.from_config({"aloe": {**spec.to_json(), "capacity": 1}})
    good = random_operator(3, 64, 24, layer=1, weight_fingerprint="fp-base")
    check_for_swap(good, spec)
    cases = {
        "fingerprint mismatch": dataclasses.replace(good, weight_fingerprint="fp-other"),
        "no weight fingerprint": dataclasses.replace(good, weight_fingerprint=None),
        "layer 2": dataclasses.replace(good, layer=2),
        "capacity of 4": random_operator(5, 64, 24, layer=1, weight_fingerprint="fp-base"),
        "d=32": random_operator(3, 32, 24, layer=1, weight_fingerprint="fp-base"),
        "gate_eps": dataclasses.replace(good, gate_eps=0.01),
        "running mean": dataclasses.replace(good, reading_decay=0.7),
    }
    for reason, op in cases.items():
        with pytest.raises(SwapRefused, match=reason):
            check_for_swap(op, spec)
    reading = dataclasses.replace(spec, reading_decay=0.7)
    check_for_swap(dataclasses.replace(good, reading_decay=0.7), reading)
    for decay in (0.0, 0.5):
        with pytest.raises(SwapRefused, match="served layer's a running mean of decay 0.7"):
            check_for_swap(dataclasses.replace(good, reading_decay=decay), reading)
    ok = {"state": "ok", "hash": "h1", "n": 3}
    assert staged_hash([ok, None, dict(ok)]) == "h1"
    assert staged_hash([ok, {"state": "pending"}]) is None
    with pytest.raises(SwapRefused, match="bad file"):
        staged_hash([ok, {"state": "error", "error": "bad file"}])
    with pytest.raises(SwapRefused, match="different operators"):
        staged_hash([ok, {**ok, "hash": "h2"}])


@pytest.fixture(scope="module")
def tiny_swap(tmp_path_factory):
    """A tiny Llama, operators A (edits 0, 1) and B (0, 1, 2), A exported with 5 slots, HF greedy tokens."""
    from aloe_build.models import load_model
    from aloe_vllm.export import export_vllm

    root = tmp_path_factory.mktemp("tiny-swap")
    base = save_tiny_model(root / "base", "llama")
    model, _ = load_model(str(base))
    tok = tiny_tokenizer()
    full = make_edit_operator(model, tok, [p for p, _ in TINY_EDITS], [t for _, t in TINY_EDITS], layer=1, steps=30)
    ops = {"A": full.select([0, 1]), "B": full}
    prompts = [p for p, _ in TINY_EDITS] + TINY_OTHER
    hf = {}
    for name, op in ops.items():
        op.save(root / name)
        apply_aloe(model, op)
        hf[name] = greedy_hf(model, tok, prompts, TOKENS)
        remove_aloe(model)
    assert hf["A"] != hf["B"], "the added edit must change an output"
    serve = export_vllm(base, root / "A", root / "serve", capacity=5)
    return dict(root=root, serve=serve, ids=[tok(p).input_ids for p in prompts], hf=hf)


def _a_b_a(t: dict, **run) -> dict:
    """A ``run_vllm_generate`` run of the tiny served model: A, swap to B, back to A."""
    swaps = [str(t["root"] / "B"), str(t["root"] / "A")]
    return {"model": str(t["serve"]), "prompt_token_ids": t["ids"], "max_tokens": TOKENS, "swaps": swaps, **run}


def test_offline_swap_tp1_and_tp2(tiny_swap, tmp_path):
    """``swap_operator`` on ``vllm.LLM``: A, swap to B, back to A; TP=2 gives the same tokens as one rank.

    Capacity 5 over two ranks: A's two edits sit on different ranks (slots 0 and 2), B's added edit in rank 0's
    share (slot 1; `format.slot_order`).
    """
    t = tiny_swap
    run = _a_b_a(t, eager=True)
    want = [t["hf"]["A"], t["hf"]["B"], t["hf"]["A"]]
    tp1, tp1_int8 = run_vllm_generate(
        [{**run, "env": {"ALOE_VLLM_SCREEN": "0"}}, {**run, "env": {"ALOE_VLLM_SCREEN": "int8"}}], env=vllm_env(1)
    )
    assert tp1 == want
    assert tp1_int8 == want  # the int8 screen is prepared again for each operator swapped in
    (tp2,) = run_vllm_generate([run], tp=2, env=vllm_env(2))
    assert tp2 == tp1


def test_compiled_server_swaps_in_place(tiny_swap):
    """Without --enforce-eager (vLLM's compiled graph): A -> B -> A gives the eager tokens, and every
    swap copies into the same storage (the compiled graph keeps reading the live tensors)."""
    t = tiny_swap
    run = _a_b_a(t, eager=False, pointers=True, env={"ALOE_VLLM_SCREEN": "0"})
    (compiled,) = run_vllm_generate([run], env=vllm_env(1))
    assert compiled["tokens"] == [t["hf"]["A"], t["hf"]["B"], t["hf"]["A"]]
    first = compiled["pointers"][0]
    assert all(p == first for p in compiled["pointers"]), compiled["pointers"]


def test_tp2_fault_on_rank_1_mid_commit_leaves_both_ranks_on_the_old_operator(tiny_swap):
    """TP=2: rank 1's write fails after it wrote three of the four tensors, and rank 0 had committed
    (``faulty_worker``). The swap raises, both ranks serve A (tokens and hashes), and the next swap to
    B goes through."""
    t = tiny_swap
    run = _a_b_a(t, eager=True, swap_errors=True, extension="faulty_worker.FaultyCommitExtension")
    run["swaps"] = [str(t["root"] / "B"), str(t["root"] / "B")]
    (out,) = run_vllm_generate([run], tp=2, env=vllm_env(2))
    assert out["errors"][0] is not None and "failed" in out["errors"][0], out["errors"]
    assert out["errors"][1] is None, out["errors"]
    assert out["tokens"] == [t["hf"]["A"], t["hf"]["A"], t["hf"]["B"]]
    hashes = [[info["operator_hash"] for info in phase] for phase in out["infos"]]
    assert hashes[1] == hashes[0] and len(set(hashes[0])) == 1, hashes
    assert hashes[2] == [AloeOperator.load(t["root"] / "B").fingerprint()] * 2, hashes
