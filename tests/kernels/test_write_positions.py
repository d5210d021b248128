"""write_positions: the residual only where the next token is generated, on tiny random models."""

import pytest
import torch
from helpers import operator_opening_on
from tiny_models import tiny_model

from aloe_kernels import AloeOperator, apply_aloe, remove_aloe, written_from
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.write_positions import check_write_positions

LAYER = 1


def _states(model, ids, mask=None):
    """Input and output of the unpatched down-projection on one forward."""
    site = locate_down_proj(model, LAYER)
    seen = {}
    handle = site.module.register_forward_hook(lambda m, a, o: seen.update(h=a[0].detach().clone(), y=o.detach().clone()))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    handle.remove()
    return seen["h"], seen["y"]


def _opening_everywhere(model, h):
    """An operator with one edit opening on every token state of ``h`` (so every position has a write)."""
    site = locate_down_proj(model, LAYER)
    op = operator_opening_on(h, n_extra=3, d_out=site.d_out)
    fields = ("addresses", "thresholds", "temperatures", "writes")
    return AloeOperator(**{k: getattr(op, k) for k in fields}, layer=LAYER)


def _reference_residual(h, op):
    """U g(h) in float64, from the definition."""
    hd = h.double()
    hbar = hd / hd.norm(dim=-1, keepdim=True).clamp_min(op.eps)
    sig = torch.sigmoid(op.temperatures.double() * (hbar @ op.addresses.double().T - op.thresholds.double()))
    g = torch.clamp_min(sig - op.gate_eps, 0) / (1 - op.gate_eps)
    return g @ op.writes.double()


def _patched_llama(shape, seed):
    """A tiny Llama patched with the default policy and an operator opening at every position of
    random ``ids`` of ``shape``: (model, ids, h, y, op), h and y from the unpatched model."""
    model = tiny_model("llama")
    ids = torch.randint(3, 128, shape, generator=torch.Generator().manual_seed(seed))
    h, y = _states(model, ids)
    op = _opening_everywhere(model, h)
    apply_aloe(model, op)
    return model, ids, h, y, op


def _patched_output(model, ids, mask=None):
    out = {}
    wrapper = locate_down_proj(model, LAYER).module
    handle = wrapper.register_forward_hook(lambda m, a, o: out.update(y=o.detach().clone()))
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)
    handle.remove()
    return out["y"]


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_prefill_writes_only_the_last_position(family, residual_path):
    model = tiny_model(family)
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    h, y = _states(model, ids)
    op = _opening_everywhere(model, h)
    apply_aloe(model, op)  # the default: "generated"
    out = _patched_output(model, ids)
    assert torch.equal(out[:, :-1], y[:, :-1])  # earlier positions keep the unedited bits
    expected = y[:, -1].double() + _reference_residual(h[:, -1], op)
    assert (_reference_residual(h[:, -1], op).abs().amax(-1) > 0.1).all()  # the last position was written
    torch.testing.assert_close(out[:, -1].double(), expected, rtol=1e-4, atol=1e-4)
    remove_aloe(model)
    apply_aloe(model, op, write_positions="all")
    out_all = _patched_output(model, ids)
    torch.testing.assert_close(out_all.double(), y.double() + _reference_residual(h, op), rtol=1e-4, atol=1e-4)


def test_written_from_starts_each_row_at_its_own_position(residual_path):
    model, ids, h, y, op = _patched_llama((3, 9), seed=2)
    starts = torch.tensor([0, 4, 8])
    with written_from(model, starts):
        out = _patched_output(model, ids)
    full = y.double() + _reference_residual(h, op)
    for b, s in enumerate(starts.tolist()):
        assert torch.equal(out[b, :s], y[b, :s])
        torch.testing.assert_close(out[b, s:].double(), full[b, s:], rtol=1e-4, atol=1e-4)
    assert locate_down_proj(model, LAYER).module.write_starts is None  # the context cleaned up


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_teacher_forced_scoring_matches_cached_generation(family, residual_path):
    """Logits of a continuation scored in one forward with written_from(prompt's last token) are
    those of a KV-cached generation that feeds the same tokens one by one."""
    model = tiny_model(family)
    g = torch.Generator().manual_seed(3)
    prompt, cont = torch.randint(3, 128, (1, 6), generator=g), torch.randint(3, 128, (1, 4), generator=g)
    full = torch.cat([prompt, cont], dim=1)
    h, _ = _states(model, full)
    apply_aloe(model, _opening_everywhere(model, h))
    with torch.no_grad(), written_from(model, torch.tensor([prompt.shape[1] - 1])):
        scored = model(input_ids=full).logits[0, prompt.shape[1] - 1 :]
    with torch.no_grad():
        res = model(input_ids=prompt, use_cache=True)
        steps = [res.logits[0, -1]]
        for t in range(cont.shape[1]):
            res = model(input_ids=cont[:, t : t + 1], past_key_values=res.past_key_values, use_cache=True)
            steps.append(res.logits[0, -1])
    torch.testing.assert_close(scored, torch.stack(steps), rtol=1e-4, atol=1e-4)
    # and written at every position the same forward differs: the policy is what matches generation
    remove_aloe(model)
    apply_aloe(model, _opening_everywhere(model, h), write_positions="all")
    with torch.no_grad():
        every = model(input_ids=full).logits[0, prompt.shape[1] - 1 :]
    assert not torch.allclose(every, scored, rtol=1e-4, atol=1e-4)


def test_one_token_calls_are_written_in_full(residual_path):
    model, ids, h, y, op = _patched_llama((4, 1), seed=4)
    out = _patched_output(model, ids)
    torch.testing.assert_close(out.double(), y.double() + _reference_residual(h, op), rtol=1e-4, atol=1e-4)


def test_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="generated, all"):
        check_write_positions("prompt")
    model = tiny_model("llama")
    site = locate_down_proj(model, LAYER)
    op = operator_opening_on(torch.randn(2, site.d), n_extra=1, d_out=site.d_out)
    with pytest.raises(ValueError, match="write_positions"):
        apply_aloe(model, op, layer=LAYER, write_positions="every")
    assert locate_down_proj(model, LAYER).module is site.module  # nothing patched
