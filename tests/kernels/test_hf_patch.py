"""apply_aloe / remove_aloe on tiny random Llama, Qwen2, Qwen3 and GPT-2 models."""

import pytest
import torch
from helpers import operator_opening_on, random_operator
from tiny_models import tiny_model, tiny_tokenizer

from aloe_kernels import AloeOperator, PatchError, apply_aloe, remove_aloe, weight_fingerprint
from aloe_kernels.hf import AloeDownProj, locate_down_proj
from aloe_kernels.screened import SCREEN_MIN_EDITS

FAMILIES = ["llama", "qwen2", "qwen3", "gpt2"]
LAYER = 1


def _inputs():
    tok = tiny_tokenizer()
    batch = tok(["The Eiffel Tower is located in the city of", "the capital of Italy is"], return_tensors="pt", padding=True)
    return batch


def _capture_down_proj_input(model, batch):
    site = locate_down_proj(model, LAYER)
    seen = {}
    handle = site.module.register_forward_hook(
        lambda m, args, out: seen.update(h=args[0].detach().clone(), y=out.detach().clone())
    )
    with torch.no_grad():
        model(**batch)
    handle.remove()
    return seen["h"], seen["y"]


def _closed_operator(site, n=9):
    op = random_operator(n, site.d, site.d_out, layer=LAYER)
    op.thresholds.fill_(2.0)  # normalized scores never exceed 1: every gate stays closed
    return op


@pytest.mark.parametrize("family", FAMILIES)
def test_closed_gates_bit_exact_and_remove_restores(family, residual_path):
    model = tiny_model(family)
    batch = _inputs()
    with torch.no_grad():
        before = model(**batch).logits.clone()
    site = locate_down_proj(model, LAYER)
    original = site.module
    apply_aloe(model, _closed_operator(site))
    assert isinstance(locate_down_proj(model, LAYER).module, AloeDownProj)
    with torch.no_grad():
        patched = model(**batch).logits
    assert torch.equal(patched, before)
    assert remove_aloe(model) == 1
    assert locate_down_proj(model, LAYER).module is original
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)


@pytest.mark.parametrize("screen", [False, True])
@pytest.mark.parametrize("family", FAMILIES)
def test_open_gates_equal_independent_residual(family, residual_path, screen):
    """On the CPU path, ``screen=True`` takes the int8 screen (exact: the same gates)."""
    model = tiny_model(family)
    batch = _inputs()
    h, wh = _capture_down_proj_input(model, batch)
    site = locate_down_proj(model, LAYER)
    rows = h.reshape(-1, site.d)[:3]  # three token states that must open their edits
    op = operator_opening_on(rows, n_extra=5, d_out=site.d_out)
    op = AloeOperator(
        **{k: getattr(op, k) for k in ("addresses", "thresholds", "temperatures", "writes")},
        layer=LAYER,
        weight_fingerprint=weight_fingerprint(site.weight()),
    )
    wrapper = apply_aloe(model, op, screen=screen, write_positions="all")
    assert (wrapper._int8_screen is not None) == (screen and site.weight().device.type == "cpu")
    out = {}
    handle = wrapper.register_forward_hook(lambda m, a, o: out.update(y=o.detach().clone()))
    with torch.no_grad():
        logits = model(**batch).logits
    handle.remove()
    # independent float64 residual on the captured states
    hd = h.double()
    hbar = hd / hd.norm(dim=-1, keepdim=True).clamp_min(op.eps)
    sig = torch.sigmoid(op.temperatures.double() * (hbar @ op.addresses.double().T - op.thresholds.double()))
    g = torch.clamp_min(sig - op.gate_eps, 0) / (1 - op.gate_eps)
    assert (g.reshape(-1, op.n)[:3, :3].diagonal() > 0.5).all() and (g[..., 3:] == 0).all()
    expected = wh.double() + g @ op.writes.double()
    torch.testing.assert_close(out["y"].double(), expected, rtol=1e-4, atol=1e-4)
    remove_aloe(model)
    with torch.no_grad():
        assert not torch.allclose(model(**batch).logits, logits)


def test_cpu_screen_by_default_from_the_operator_size():
    model = tiny_model("llama")
    site = locate_down_proj(model, LAYER)
    for n, screened in ((SCREEN_MIN_EDITS - 1, False), (SCREEN_MIN_EDITS, True)):
        wrapper = apply_aloe(model, random_operator(n, site.d, site.d_out, layer=LAYER))
        assert (wrapper._int8_screen is not None) == screened
        remove_aloe(model)
    wrapper = apply_aloe(model, random_operator(SCREEN_MIN_EDITS, site.d, site.d_out, layer=LAYER), screen=False)
    assert wrapper._int8_screen is None
    remove_aloe(model)
    wrapper = apply_aloe(model, random_operator(8, site.d, site.d_out, layer=LAYER), screen=True)
    assert wrapper._int8_screen is not None
    wrapper.to(torch.float64)  # a float64 operator takes the plain path
    assert wrapper._int8_screen is None
    remove_aloe(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_generate_works_patched(family):
    model = tiny_model(family)
    tok = tiny_tokenizer()
    batch = tok(["The capital of France is", "the a"], return_tensors="pt", padding=True)
    site = locate_down_proj(model, LAYER)
    with torch.no_grad():
        before = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    apply_aloe(model, _closed_operator(site))
    with torch.no_grad():
        closed = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(closed, before)
    remove_aloe(model)
    h, _ = _capture_down_proj_input(model, batch)
    apply_aloe(model, operator_opening_on(h.reshape(-1, site.d), 0, site.d_out), layer=LAYER, write_positions="all")
    with torch.no_grad():
        opened = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert opened.shape == before.shape


def test_gradients_flow_through_writes():
    model = tiny_model("llama")
    site = locate_down_proj(model, LAYER)
    h, _ = _capture_down_proj_input(model, _inputs())
    wrapper = apply_aloe(model, operator_opening_on(h.reshape(-1, site.d)[:2], 2, site.d_out), layer=LAYER, write_positions="all")
    wrapper.writes.requires_grad_(True)
    model(**_inputs()).logits.sum().backward()
    assert wrapper.writes.grad is not None and wrapper.writes.grad[:2].abs().sum() > 0


def test_refusals():
    model = tiny_model("llama")
    site = locate_down_proj(model, LAYER)
    op = _closed_operator(site)
    with pytest.raises(PatchError, match="out of range"):
        apply_aloe(model, op, layer=7)
    with pytest.raises(PatchError, match="built for layer 1"):
        apply_aloe(model, op, layer=0)
    no_layer = random_operator(2, site.d, site.d_out)
    with pytest.raises(PatchError, match="no layer given"):
        apply_aloe(model, no_layer)
    with pytest.raises(PatchError, match="d=48"):
        apply_aloe(model, random_operator(2, site.d + 1, site.d_out), layer=LAYER)
    with pytest.raises(PatchError, match="d_out=32"):
        apply_aloe(model, random_operator(2, site.d, site.d_out + 2), layer=LAYER)
    wrong = random_operator(2, site.d, site.d_out, layer=LAYER, weight_fingerprint="sha256-bf16:deadbeef")
    with pytest.raises(PatchError, match="fingerprint"):
        apply_aloe(model, wrong)
    other = tiny_model("llama", seed=5)
    right = random_operator(
        2, site.d, site.d_out, layer=LAYER, weight_fingerprint=weight_fingerprint(locate_down_proj(other, LAYER).weight())
    )
    with pytest.raises(PatchError, match="fingerprint"):
        apply_aloe(model, right)
    apply_aloe(other, right)
    with pytest.raises(PatchError, match="already patched"):
        apply_aloe(other, right)
    with pytest.raises(PatchError, match="no decoder layer"):
        apply_aloe(torch.nn.Linear(3, 3), op)
    assert remove_aloe(model) == 0


def test_fingerprint_is_dtype_robust():
    model = tiny_model("llama")
    w = locate_down_proj(model, LAYER).weight()
    assert weight_fingerprint(w) == weight_fingerprint(w.to(torch.bfloat16).float())
    assert weight_fingerprint(w) != weight_fingerprint(w * 1.01)


def test_operator_dtype_as_served_or_as_asked():
    """The operator is patched in float32 on CPU and in the weight's dtype on a GPU, unless a dtype is asked
    for; a bfloat16 patch adds the residual of the bfloat16-rounded tensors (what a GPU serving the model in
    bfloat16 computes)."""
    model = tiny_model("llama").to(torch.bfloat16)
    batch = _inputs()
    h, wh = _capture_down_proj_input(model, batch)
    site = locate_down_proj(model, LAYER)
    op = operator_opening_on(h.reshape(-1, site.d)[:3].float(), n_extra=4, d_out=site.d_out)
    op = AloeOperator(**{k: getattr(op, k) for k in ("addresses", "thresholds", "temperatures", "writes")}, layer=LAYER)
    wrapper = apply_aloe(model, op, write_positions="all")
    served = torch.float32 if site.weight().device.type == "cpu" else torch.bfloat16
    assert all(getattr(wrapper, k).dtype == served for k in ("addresses", "thresholds", "temperatures", "writes"))
    remove_aloe(model)
    wrapper = apply_aloe(model, op, dtype=torch.bfloat16, write_positions="all")
    rounded = {k: getattr(op, k).to(torch.bfloat16) for k in ("addresses", "thresholds", "temperatures", "writes")}
    assert all(torch.equal(getattr(wrapper, k), v) for k, v in rounded.items())
    out = {}
    handle = wrapper.register_forward_hook(lambda m, a, o: out.update(y=o.detach().clone()))
    with torch.no_grad():
        model(**batch)
    handle.remove()
    hd = h.double()
    hbar = hd / hd.norm(dim=-1, keepdim=True).clamp_min(op.eps)
    r = {k: v.double() for k, v in rounded.items()}
    g = torch.clamp_min(torch.sigmoid(r["temperatures"] * (hbar @ r["addresses"].T - r["thresholds"])) - op.gate_eps, 0) / (
        1 - op.gate_eps
    )
    assert (g.reshape(-1, op.n)[:3, :3].diagonal() > 0.5).all()
    expected = wh.double() + g @ r["writes"]
    # one bfloat16 rounding of the output, relative to its scale
    torch.testing.assert_close(out["y"].double(), expected, rtol=1e-2, atol=1e-2 * float(expected.abs().max()))
