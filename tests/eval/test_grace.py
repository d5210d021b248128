"""The GRACE reimplementation: fitting, patching, codebook rules, and its scores."""

from __future__ import annotations

import pytest
import torch
from eval_helpers import LAYER, tiny_requests
from helpers import stopping_at
from tiny_models import tiny_model, tiny_tokenizer

from aloe_eval import evaluate
from aloe_eval.baselines.grace import GraceConfig, GraceDownProj, _codebook, fit_grace
from aloe_kernels.hf import locate_down_proj


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


def test_grace_reimplementation(tiny):
    model, tok = tiny
    reqs = tiny_requests()
    site = locate_down_proj(model, LAYER)
    batch = tok(["Toko Yasuda plays the"], return_tensors="pt")
    with torch.no_grad():
        before = model(**batch).logits.clone()
    # batch_size=1: every edit after the first is trained in a later batch, at a global entry index > 0
    ed = fit_grace(model, tok, reqs, LAYER, GraceConfig(n_iter=30), batch_size=1, progress=False)
    assert locate_down_proj(model, LAYER).module is site.module  # fitting leaves the model unpatched
    assert ed.name == "GRACE (reimplementation)" and ed.info()["n_entries"] >= 1
    ed.attach(model)
    assert isinstance(locate_down_proj(model, LAYER).module, GraceDownProj)
    ed.detach(model)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)
    rep = evaluate(model, tok, reqs, ed, progress=False)
    rows = {r["id"]: r for r in rep.rows}
    # the single-token targets come out (a tiny random model cannot be steered to two tokens by one value)
    assert rows["e0"]["efficacy"] == 1.0 and rows["e1"]["efficacy"] == 1.0
    assert rep.summary["diagnostics"]["request_gate_open"] == 1.0
    assert rep.summary["diagnostics"]["matched_slot_dominates"] == 1.0


def test_grace_codebook_rules():
    keys = torch.tensor([[0.0, 0.0], [0.5, 0.0], [10.0, 0.0], [10.8, 0.0]])
    K, eps, slots, labels, stats = _codebook(keys, ["a", "a", "b", "c"], GraceConfig(eps=1.0))
    # key 1 is within reach of key 0 with the same label: shared entry, radius grows to cover it (coverage)
    assert slots[:2] == [0, 0] and eps[0] == pytest.approx(1.0)
    # key 3 conflicts with key 2 (distance 0.8 < 1 + 1, other label): new entry, both radii halved
    assert slots[2:] == [1, 2] and K.shape[0] == 3
    assert eps[1] == pytest.approx(0.4 - 1e-5, abs=1e-6) and eps[2] == pytest.approx(0.4)
    assert stats["conflict_splits"] == 1


def test_an_interrupted_grace_fit_resumes_at_its_first_untrained_batch(tiny, tmp_path, monkeypatch):
    """Fitted one edit per batch with a checkpoint directory: a fit stopped in its second batch keeps
    the first, the rerun trains only the rest and ends with the values of a fit never stopped, and a
    third fit trains nothing; another config is trained from scratch."""
    import aloe_eval.baselines.grace as grace

    model, tok = tiny
    reqs = tiny_requests()
    assert len(reqs) >= 2
    cfg = GraceConfig(n_iter=30)
    whole = fit_grace(model, tok, reqs, LAYER, cfg, batch_size=1, progress=False)

    real, calls = grace._train_batch, []
    monkeypatch.setattr(grace, "_train_batch", stopping_at(2, real, calls))
    with pytest.raises(KeyboardInterrupt):
        fit_grace(model, tok, reqs, LAYER, cfg, batch_size=1, progress=False, checkpoint_dir=tmp_path)
    monkeypatch.setattr(grace, "_train_batch", stopping_at(0, real, calls))
    calls.clear()
    resumed = fit_grace(model, tok, reqs, LAYER, cfg, batch_size=1, progress=False, checkpoint_dir=tmp_path)
    assert len(calls) == len(reqs) - 1 and resumed.info()["resumed_batches"] == 1
    assert torch.equal(resumed.values, whole.values) and torch.equal(resumed.keys, whole.keys)
    assert resumed.info()["train_final_nll"] == whole.info()["train_final_nll"]
    calls.clear()
    again = fit_grace(model, tok, reqs, LAYER, cfg, batch_size=1, progress=False, checkpoint_dir=tmp_path)
    assert calls == [] and torch.equal(again.values, whole.values)
    fit_grace(model, tok, reqs, LAYER, GraceConfig(n_iter=20), batch_size=1, progress=False, checkpoint_dir=tmp_path)
    assert len(calls) == len(reqs)
