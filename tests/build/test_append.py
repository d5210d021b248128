"""Appending, removing and updating edits of a built operator, on a tiny model."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from test_pipeline import _edits, _tiny_cfg
from tiny_models import tiny_model, tiny_tokenizer

from aloe_build.append import append_edits, load_with_state, plan_append, remove_edits, update_edits
from aloe_build.build_state import BuildState, BuildStateError
from aloe_build.data import EditRequest, save_edits_jsonl
from aloe_build.pipeline import BuildError, build_operator
from aloe_build.states import last_token_states
from aloe_cli import main
from aloe_kernels import AloeOperator, aloe_gates

_NEW = EditRequest(prompt="Toko Yasuda plays the", target_new="piano", subject="Toko Yasuda", id="c")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """An operator for two edits, saved with its build state."""
    tmp = tmp_path_factory.mktemp("append")
    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = _tiny_cfg(tmp, refine_steps=200)
    op = build_operator(model, tok, _edits()[:2], cfg, out_dir=tmp / "base", log=None)
    op.save(tmp / "base")
    return model, tok, cfg, tmp


def _request_gates(model, tok, op, prompts):
    return aloe_gates(last_token_states(model, tok, prompts, 1), op)


def test_build_writes_a_state_bound_to_its_operator(built):
    _model, _tok, _cfg, tmp = built
    op, state = load_with_state(tmp / "base")
    assert state.n == op.n == 2 and state.anchors.shape[1] == op.d
    assert set(state.anchor_owner.tolist()) == {0, 1}
    assert (state.worst_positive > state.worst_negative).any()
    other = op.select([1, 0])
    other.save(tmp / "other")
    with pytest.raises(BuildStateError, match="has no build state"):
        BuildState.load(tmp / "other", other)
    for name in ("aloe_build_state.json", "aloe_build_state.safetensors"):
        shutil.copy(tmp / "base" / name, tmp / "other" / name)
    with pytest.raises(BuildStateError, match="belongs to operator"):
        BuildState.load(tmp / "other", other)
    (tmp / "other" / "aloe_build_state.safetensors").write_bytes(b"truncated")
    other.save(tmp / "other")
    with pytest.raises(BuildStateError):
        load_with_state(tmp / "other")


def test_append_adds_a_slot_that_opens_on_its_request_only(built, tmp_path):
    model, tok, _cfg, tmp = built
    op = append_edits(model, tok, tmp / "base", [_NEW], out_dir=tmp_path / "app", log=None)
    op.save(tmp_path / "app")
    assert op.n == 3 and op.ids == ["a", "b", "c"]
    base = AloeOperator.load(tmp / "base")
    assert torch.equal(op.addresses[:2], base.addresses) and torch.equal(op.writes[:2], base.writes)
    # one batch of states for both operators: a state's float32 rounding depends on its batch's padding
    h = last_token_states(model, tok, [e.prompt for e in _edits()[:2]] + [_NEW.prompt], 1)
    g = aloe_gates(h, op)
    assert g[2, 2] > 0 and (g[:2, 2] == 0).all() and (g[2, :2] == 0).all()  # the new slot and the old ones stay apart
    # an old slot keeps its gate unless it would have opened on the new states; then it is shut on them
    before = aloe_gates(h[:2], base).diagonal()
    moved = (op.thresholds[:2] != base.thresholds).nonzero().squeeze(1).tolist()
    for i in range(2):
        if i not in moved:
            # the same address, threshold and temperature; the score product's rounding depends on n
            assert op.temperatures[i] == base.temperatures[i]
            torch.testing.assert_close(g[i, i], before[i], rtol=1e-3, atol=1e-8)
    new_states = last_token_states(model, tok, [_NEW.prompt], 1)
    if moved:
        assert float(aloe_gates(new_states, op.select(moved)).max()) == 0.0
    report = (tmp_path / "app" / "build_report.json").read_text()
    assert '"5_recalibrate_base"' in report and '"recalibrated"' in report
    again, state = load_with_state(tmp_path / "app")
    assert state.n == 3 and again.fingerprint() == op.fingerprint()


def test_append_reports_duplicates_and_refuses_conflicts(built):
    model, tok, _cfg, tmp = built
    base = AloeOperator.load(tmp / "base")
    same = _edits()[0]
    plan = plan_append(base, [same, _NEW])
    assert plan.already_present == [same] and plan.new == [_NEW] and not plan.conflicts
    said = []
    op = append_edits(model, tok, tmp / "base", [same], log=said.append)
    assert op.fingerprint() == base.fingerprint() and "already in the operator" in said[0]
    clash = dataclasses.replace(same, target_new="Berlin", id="z")
    with pytest.raises(BuildError, match="conflict"):
        append_edits(model, tok, tmp / "base", [clash], log=None)


def test_remove_drops_the_slot_and_its_state(built):
    model, tok, _cfg, tmp = built
    op, state = load_with_state(tmp / "base")
    kept, kept_state = remove_edits(op, state, ["a"])
    assert kept.ids == ["b"] and kept_state.n == 1 and set(kept_state.anchor_owner.tolist()) == {0}
    assert torch.equal(kept.addresses[0], op.addresses[1])
    assert float(_request_gates(model, tok, kept, [_edits()[0].prompt]).max()) == 0.0
    with pytest.raises(BuildError, match="no edit with id 'nope'"):
        remove_edits(op, state, ["nope"])


def test_update_replaces_the_target_of_a_fact(built, tmp_path):
    model, tok, _cfg, tmp = built
    corrected = dataclasses.replace(_edits()[1], target_new="Paris")
    op = update_edits(model, tok, tmp / "base", [corrected], out_dir=tmp_path / "upd", log=None)
    assert op.n == 2 and sorted(op.ids) == ["a", "b"]
    row = op.ids.index("b")
    assert op.edits[row]["target"] == "Paris"
    g = _request_gates(model, tok, op, [corrected.prompt])
    assert float(g[0, row]) > 0


def test_cli_append_and_remove(built, tmp_path, capsys):
    model, tok, _cfg, tmp = built
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    edits = save_edits_jsonl([_NEW], tmp_path / "new.jsonl")
    assert (
        main(
            [
                "append",
                "--model",
                str(model_dir),
                "--operator",
                str(tmp / "base"),
                "--edits",
                str(edits),
                "--out",
                str(tmp_path / "app"),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert AloeOperator.load(tmp_path / "app").ids == ["a", "b", "c"]
    assert main(["remove", "--operator", str(tmp_path / "app"), "--ids", "a", "c", "--out", str(tmp_path / "rm")]) == 0
    op, state = load_with_state(tmp_path / "rm")
    assert op.ids == ["b"] and state.n == 1
    assert main(["remove", "--operator", str(tmp_path / "rm"), "--ids", "b", "--out", str(tmp_path / "rm")]) == 2
    assert "--out must differ" in capsys.readouterr().err


def test_a_running_reading_operator_keeps_its_reading_through_append_remove_and_update(tmp_path):
    from aloe_kernels.reading import attach_reading, detach_reading

    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = _tiny_cfg(tmp_path, refine_steps=200, reading_decay=0.6)
    build_operator(model, tok, _edits()[:2], cfg, out_dir=tmp_path / "base", log=None).save(tmp_path / "base")
    op = append_edits(model, tok, tmp_path / "base", [_NEW], out_dir=tmp_path / "app", log=None)
    assert op.n == 3 and op.reading_decay == 0.6
    attach_reading(model, 0.6)  # the states the gates read: the new slot opens on its request's reading
    try:
        g = _request_gates(model, tok, op, [_NEW.prompt])
    finally:
        detach_reading(model)
    assert float(g[0, 2]) > 0
    kept, _ = remove_edits(*load_with_state(tmp_path / "base"), ["a"])
    assert kept.reading_decay == 0.6
    corrected = dataclasses.replace(_edits()[1], target_new="Paris")
    assert update_edits(model, tok, tmp_path / "base", [corrected], log=None).reading_decay == 0.6
    with pytest.raises(BuildError, match="reading"):
        append_edits(model, tok, tmp_path / "base", [_NEW], config=dataclasses.replace(cfg, reading_decay=0.0), log=None)
