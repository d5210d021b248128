"""`aloe mechanism --states`: collected states are reused only for the same model, layer, corpus and partitions."""

from __future__ import annotations

import pytest
from tiny_models import tiny_model, tiny_tokenizer

import aloe_eval.mechanism as mechanism
from aloe_build.config import BuildConfig
from aloe_build.data import EditRequest, save_edits_jsonl

_TEMPLATES = [
    ("{} was born in", "{} came into the world in"),
    ("{} works as a", "The job of {} is"),
    ("{} speaks", "The language of {} is"),
    ("{} plays the", "The instrument of {} is"),
    ("{} lives in", "The home of {} is"),
]
_SUBJECTS = [f"Person{i}" for i in range(24)]


def _corpus_file(path):
    records = [
        EditRequest(
            prompt=t.format(s),
            target_new="x",
            subject=s,
            ground_truth="y",
            rephrases=(r.format(s),),
            locality=(t.format(_SUBJECTS[(i + 7) % len(_SUBJECTS)]),),
            id=f"{i}-{j}",
        )
        for i, s in enumerate(_SUBJECTS)
        for j, (t, r) in enumerate(_TEMPLATES)
    ]
    save_edits_jsonl(records, path)
    return path


def _forbid_state_passes(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("states were collected again")

    monkeypatch.setattr(mechanism, "corpus_states", fail)
    monkeypatch.setattr(mechanism, "dev_key_states", fail)


def test_states_file_is_reused_for_other_training_settings_only(tmp_path, monkeypatch):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    corpus, states = _corpus_file(tmp_path / "corpus.jsonl"), tmp_path / "states.safetensors"
    cfg = BuildConfig(encoder_dim=8, encoder_steps=20, encoder_batch=8)

    def study(c: BuildConfig, layer: int = 1):
        return mechanism.mechanism_study(model, tok, corpus, layer, c, seeds=[0], dev_items=12, states_path=states)

    first = study(cfg)
    assert states.is_file()
    without_file = mechanism.mechanism_study(model, tok, corpus, 1, cfg, seeds=[0], dev_items=12)
    assert first["subject"] == without_file["subject"] and first["relation"] == without_file["relation"]

    _forbid_state_passes(monkeypatch)
    again = study(cfg)
    assert again["subject"] == first["subject"] and again["relation"] == first["relation"]
    study(BuildConfig(encoder_dim=8, encoder_steps=30, encoder_batch=8, encoder_threshold_weight=0.0))
    for other_states in (dict(layer=0), dict(c=BuildConfig(encoder_dim=8, encoder_steps=20, encoder_batch=8, seed=5))):
        with pytest.raises(AssertionError, match="collected again"):
            study(**{"c": cfg, **other_states})
