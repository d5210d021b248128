"""Chat slots (``BuildConfig.chat.chat_slots``): each edit's chat forms in a slot of their own."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from test_addresses import _synthetic
from test_pipeline import _edits, _rows_contain, _tiny_cfg, recording_write_targets
from tiny_models import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer

from aloe_build.append import append_edits, load_with_state, plan_append, remove_edits, update_edits
from aloe_build.config import BuildConfig
from aloe_build.data import EditRequest
from aloe_build.pipeline import build_operator
from aloe_build.slot_sets import negative_set
from aloe_build.stages import s4_refine as addr
from aloe_build.stages import s5_calibrate as calibration
from aloe_build.states import collect_states
from aloe_build.tokens import chat_answer, chat_prompt, encode_continuation
from aloe_eval.editors import AloeEditor

OPEN_GATE, GATE_EPS = 0.9, 1e-3


def _gate(score: torch.Tensor, tau: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """The dead-zone sigmoid of the paper, written out."""
    return ((torch.sigmoid(alpha * (score - tau)) - GATE_EPS) / (1 - GATE_EPS)).clamp_min(0)


def test_chat_slots_need_chat_positives():
    with pytest.raises(ValueError, match="chat_slots needs positives_chat"):
        BuildConfig(chat_slots=True, positives_chat=False)
    assert BuildConfig(chat_slots=True, positives_chat=True).chat.chat_slots


def test_calibration_takes_each_slots_own_open_at():
    """Slots given open_at 1 reach open_gate at their worst anchor, those given 0.5 halfway from the
    worst negative to it, whatever the configured value; every worst negative stays in the dead zone."""
    V0, anchors, owner, neg, same = _synthetic()
    V, _ = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(refine_steps=400, refine_hard_negatives=8))
    open_at = torch.tensor([0.5, 1.0, 0.5, 1.0, 1.0, 0.5], dtype=torch.float64)
    cal = calibration.calibrate(V, anchors, owner, neg, same, GATE_EPS, BuildConfig(calibration_open_at=0.5), open_at=open_at)
    assert cal.separable.all()
    s_pos, s_neg = cal.worst_positive, cal.worst_negative
    reach = s_neg + open_at.float() * (s_pos - s_neg)
    torch.testing.assert_close(_gate(reach, cal.thresholds, cal.temperatures), torch.full((6,), OPEN_GATE), rtol=0, atol=1e-4)
    assert _gate(s_neg, cal.thresholds, cal.temperatures).max() == 0.0
    wide = open_at < 1
    assert (_gate(s_pos, cal.thresholds, cal.temperatures)[wide] > OPEN_GATE + 0.01).all()


def test_an_edits_own_negatives_are_its_chat_slots_too():
    roll = {
        "pool": torch.randn(3, 4),
        "anchors": torch.randn(4, 4),
        "anchor_owner": torch.tensor([0, 1, 2, 3]),
        "continuations": torch.randn(2, 4),
        "continuation_owner": torch.tensor([0, 1]),
        "specific": torch.randn(5, 4),
        "specific_owner": torch.tensor([0, 0, 1, 1, 1]),
    }
    plain = negative_set(roll)
    assert torch.equal(plain.specific_owner, roll["specific_owner"])
    twins = negative_set(roll, chat_slots=2)
    assert torch.equal(twins.specific, torch.cat([roll["specific"], roll["specific"]]))
    assert twins.specific_owner.tolist() == [0, 0, 1, 1, 1, 2, 2, 3, 3, 3]
    assert torch.equal(twins.shared, plain.shared) and torch.equal(twins.shared_owner, plain.shared_owner)


@pytest.fixture(scope="module")
def chat_built(tmp_path_factory):
    """Three edits built with chat slots and wide request gates, the sequences each write target
    was fitted on recorded."""
    import aloe_build.pipeline as pipeline

    tmp = tmp_path_factory.mktemp("chat_slots")
    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    edits = _edits()[:3]
    seen = []
    real = pipeline.write_targets
    pipeline.write_targets = recording_write_targets(seen)
    try:
        cfg = _tiny_cfg(
            tmp, positives_chat=True, positives_prefixed=0, chat_slots=True, calibration_open_at=0.5, refine_steps=200
        )
        op = build_operator(model, tok, edits, cfg, out_dir=tmp / "op", log=None)
    finally:
        pipeline.write_targets = real
    op.save(tmp / "op")
    return model, tok, edits, op, seen[0], tmp / "op"


def test_each_edit_gets_a_chat_slot_anchored_on_its_chat_form(chat_built):
    model, tok, edits, op, _seen, out = chat_built
    n = len(edits)
    assert op.n == 2 * n
    assert [e["id"] for e in op.edits] == ["a", "b", "c", "a#chat", "b#chat", "c#chat"]
    assert [e.get("form") for e in op.edits] == [None] * n + ["chat"] * n
    assert [e["ids"] for e in op.edits[n:]] == [e["ids"] for e in op.edits[:n]]
    _op, state = load_with_state(out)
    for i, e in enumerate(edits):
        prompt, answer = chat_prompt(tok, e.prompt), chat_answer(tok, e.target_new)
        chat_h = collect_states(model, tok, [prompt + answer], 1, [[len(prompt) - 1]]).states
        p, _t = encode_continuation(tok, e.prompt, e.target_new)
        request_h = collect_states(model, tok, [list(p)], 1, [[len(p) - 1]]).states
        assert _rows_contain(state.anchors[state.anchor_owner == n + i], chat_h)
        assert not _rows_contain(state.anchors[state.anchor_owner != n + i], chat_h)
        assert _rows_contain(state.anchors[state.anchor_owner == i], request_h)
        assert not _rows_contain(state.anchors[state.anchor_owner == n + i], request_h)


def test_request_slots_open_wide_and_chat_slots_at_their_worst_anchor(chat_built):
    _model, _tok, edits, op, _seen, out = chat_built
    n = len(edits)
    _op, state = load_with_state(out)
    tau, alpha = op.thresholds.float(), op.temperatures.float()
    norms = op.addresses.float().norm(dim=1)
    s_pos, s_neg = state.worst_positive, state.worst_negative
    separable = (s_pos - s_neg) > 1e-6 * norms
    assert separable.sum() >= n  # at least half the slots separate on the tiny model
    open_at = torch.tensor([0.5] * n + [1.0] * n)
    at = _gate(s_neg + open_at * (s_pos - s_neg), tau, alpha)
    torch.testing.assert_close(at[separable], torch.full((int(separable.sum()),), OPEN_GATE), rtol=0, atol=1e-3)
    assert not math.isnan(float(at.sum()))


def test_chat_slots_write_on_the_chat_forms_and_request_slots_on_the_requests(chat_built):
    _model, tok, edits, _op, seen, _out = chat_built
    n = len(edits)
    assert len(seen) == 2 * n
    for i, e in enumerate(edits):
        prompt, target = encode_continuation(tok, e.prompt, e.target_new)
        assert seen[i] == [list(prompt) + list(target)]
        assert seen[n + i] == [chat_prompt(tok, e.prompt) + chat_answer(tok, e.target_new)]


def test_chat_slot_follows_its_edit_in_the_evaluation_and_on_removal(chat_built):
    _model, _tok, edits, op, _seen, out = chat_built
    n = len(edits)
    editor = AloeEditor(op)
    for i, e in enumerate(edits):
        assert editor.slot_of(e, i) == i and editor.chat_slot_of(e, i) == n + i
    assert len(plan_append(op, edits).already_present) == n
    _op, state = load_with_state(out)
    kept, kept_state = remove_edits(op, state, ["b"])
    assert kept.ids == ["a", "c", "a#chat", "c#chat"] and kept_state.n == 4
    assert torch.equal(kept.addresses[3], op.addresses[5])


def test_a_chat_slot_shared_by_two_edits_keeps_a_unique_id(chat_built):
    """Identical edits share a slot, and its chat slot: removing the first id renames both."""
    _model, _tok, _edits_, op, _seen, out = chat_built
    _op, state = load_with_state(out)
    shared = op.select(list(range(op.n)))
    shared.edits[2] = {**shared.edits[2], "ids": ["c", "c-dup"]}
    shared.edits[5] = {**shared.edits[5], "ids": ["c", "c-dup"]}
    kept, _state = remove_edits(shared, state, ["c"])
    assert kept.ids == ["a", "b", "c-dup", "a#chat", "b#chat", "c-dup#chat"]


def test_append_and_update_give_new_edits_chat_slots_too(chat_built, tmp_path):
    """An operator built with chat slots appends with its own config: each new edit gets both slots,
    and correcting a fact replaces both of its slots."""
    model, tok, edits, op, _seen, out = chat_built
    new = EditRequest(prompt="The capital of Italy is", target_new="Paris", subject="Italy", id="d")
    grown = append_edits(model, tok, out, [new], out_dir=tmp_path / "grown", log=None)
    assert grown.ids == [e["id"] for e in op.edits] + ["d", "d#chat"]
    assert [e.get("form") for e in grown.edits[-2:]] == [None, "chat"]
    corrected = dataclasses.replace(edits[1], target_new="Paris")
    updated = update_edits(model, tok, out, [corrected], out_dir=tmp_path / "updated", log=None)
    assert sorted(updated.ids) == sorted(e["id"] for e in op.edits)
    assert {e["target"] for e in updated.edits if e["ids"] == ["b"]} == {"Paris"}


def test_the_evaluation_counts_either_slot_of_an_edit_as_its_own(chat_built):
    _model, _tok, edits, op, _seen, _out = chat_built
    editor = AloeEditor(op)
    n = len(edits)
    assert [editor.edit_slots(e, i) for i, e in enumerate(edits)] == [(i, n + i) for i in range(n)]
