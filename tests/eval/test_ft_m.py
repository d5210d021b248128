"""FT-M: one down-projection fine-tuned on the target tokens only, edit after edit."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from eval_helpers import tiny_requests
from helpers import stopping_at
from tiny_models import tiny_model, tiny_tokenizer

from aloe_build.tokens import encode_continuation
from aloe_eval.baselines.ft_m import FtmSettings, fit_ft_m, ftm_layer
from aloe_kernels.hf import locate_down_proj

LAYER = 1


@pytest.fixture()
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


def _target_nll(model, tok, request) -> float:
    p, t = encode_continuation(tok, request.prompt, request.target_new)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(p) + list(t)])).logits[0].float()
    return float(F.cross_entropy(logits[len(p) - 1 : -1], torch.tensor(t)))


def test_fitting_leaves_the_model_as_it_was_and_detach_restores_it_bit_for_bit(tiny):
    model, tok = tiny
    reqs = tiny_requests()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    ed = fit_ft_m(model, tok, reqs, FtmSettings(layer=LAYER, steps=5))
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert not any(p.requires_grad for p in model.parameters())
    batch = tok(["Toko Yasuda plays the"], return_tensors="pt")
    with torch.no_grad():
        before = model(**batch).logits.clone()
        ed.attach(model)
        edited = model(**batch).logits.clone()
        ed.detach(model)
        after = model(**batch).logits
    assert not torch.equal(edited, before)
    assert torch.equal(after, before)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert ed.info()["layers"] == [LAYER] and ed.name == "FT-M (reimplementation)"


def test_one_step_is_adams_first_step_on_the_target_tokens_loss_alone(tiny):
    """With one step, the change is Adam's first update, lr * g / (|g| + eps), where g is the gradient
    of the mean cross-entropy of the target tokens only (computed here on the full logits); the
    gradient of a loss that also scores the prompt tokens gives another change."""
    model, tok = tiny
    r = tiny_requests()[0]
    lr = 1e-3
    ed = fit_ft_m(model, tok, [r], FtmSettings(layer=LAYER, steps=1, lr=lr))
    p, t = encode_continuation(tok, r.prompt, r.target_new)
    ids = torch.tensor([list(p) + list(t)])
    w = locate_down_proj(model, LAYER).base.weight
    w.requires_grad_(True)
    try:
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
        nll = -logp[:-1].gather(1, ids[0, 1:, None])[:, 0]  # the NLL of every next token
        (g_target,) = torch.autograd.grad(nll[len(p) - 1 :].mean(), w, retain_graph=True)
        (g_all,) = torch.autograd.grad(nll.mean(), w)
    finally:
        w.requires_grad_(False)

    def adam_first(g):
        return -lr * g / (g.abs() + 1e-8)

    assert torch.allclose(ed.deltas[LAYER], adam_first(g_target), atol=1e-7)
    assert not torch.allclose(ed.deltas[LAYER], adam_first(g_all), atol=1e-5)


def test_the_target_loss_falls_and_edits_are_fine_tuned_in_turn(tiny):
    """The edit's target NLL falls; the second edit is fine-tuned on the model carrying the first, so
    the change of the pair is the first edit's plus the second's fitted on the edited model."""
    model, tok = tiny
    r0, r1 = tiny_requests()[:2]
    settings = FtmSettings(layer=LAYER, steps=10, lr=1e-3)
    both = fit_ft_m(model, tok, [r0, r1], settings)
    first = fit_ft_m(model, tok, [r0], settings)
    before = _target_nll(model, tok, r0)
    first.attach(model)
    try:
        assert _target_nll(model, tok, r0) < before
        second = fit_ft_m(model, tok, [r1], settings)
    finally:
        first.detach(model)
    assert torch.allclose(both.deltas[LAYER], first.deltas[LAYER] + second.deltas[LAYER], atol=1e-6)


def test_an_interrupted_fit_resumes_after_its_last_saved_edit(tiny, tmp_path, monkeypatch):
    import aloe_eval.baselines.ft_m as ft_m

    model, tok = tiny
    reqs = tiny_requests()
    settings = FtmSettings(layer=LAYER, steps=5)
    whole = fit_ft_m(model, tok, reqs, settings)
    real, calls = ft_m._fine_tune, []
    monkeypatch.setattr(ft_m, "_fine_tune", stopping_at(2, real, calls))
    with pytest.raises(KeyboardInterrupt):
        fit_ft_m(model, tok, reqs, settings, checkpoint_dir=tmp_path, checkpoint_every=1)
    monkeypatch.setattr(ft_m, "_fine_tune", stopping_at(0, real, calls))
    calls.clear()
    resumed = fit_ft_m(model, tok, reqs, settings, checkpoint_dir=tmp_path, checkpoint_every=1)
    assert len(calls) == len(reqs) - 1 and resumed.info()["resumed_edits"] == 1
    assert resumed.info()["peak_memory_mb"] > 0  # the fit records the process peak, as the weight editors do
    assert torch.equal(resumed.deltas[LAYER], whole.deltas[LAYER])
    assert resumed.state_key() == whole.state_key()


@pytest.mark.parametrize("depth, chosen, reference", [(30, 8, 20), (32, 9, 21), (3, 1, 2)])
def test_the_layers_are_scaled_to_the_depth(depth, chosen, reference):
    model = tiny_model("llama", num_layers=depth)
    assert ftm_layer(model) == chosen and ftm_layer(model, reference=True) == reference


def test_ft_m_is_a_baseline_of_the_protocol_and_the_cli(tiny, tmp_path, monkeypatch):
    from aloe_cli.eval import _add_baseline_args
    from aloe_eval.protocol import fit_baseline

    monkeypatch.setenv("ALOE_CACHE", str(tmp_path))
    model, tok = tiny
    ed = fit_baseline("ft-m", model, tok, tiny_requests()[:1], layer=0)
    assert ed.info()["kind"] == "ft-m" and ed.fit_seconds is not None
    assert list((tmp_path / "ft-m").glob("ft-m-layer*.safetensors"))
    import argparse

    p = argparse.ArgumentParser()
    _add_baseline_args(p)
    assert p.parse_args(["--baseline", "ft-m", "--baseline", "wise"]).baseline == ["ft-m", "wise"]
