"""Evaluation in chunks of edits: the same rows and summary as one pass, saved chunk by chunk, and
an interrupted run resumes at the first chunk not yet scored."""

from __future__ import annotations

import math

import pytest
from eval_helpers import gate_operator, tiny_requests
from tiny_models import tiny_model, tiny_tokenizer

import aloe_eval.protocol as protocol
from aloe_build.data import EditRequest
from aloe_eval import evaluate
from aloe_eval.chunks import chunk_bounds
from aloe_eval.editors import UneditedEditor


def _requests():
    # a fourth edit whose locality prompt is the first edit's: the unique-prompt statistics must count it once
    return tiny_requests() + [
        EditRequest(
            "Toko Yasuda plays the",
            "piano",
            "Toko Yasuda",
            id="e3",
            locality=[{"prompt": "Toko Yasuda plays the", "ground_truth": "guitar", "kind": "neighborhood"}],
        )
    ]


def _same(a, b, path="") -> None:
    """Equal structures; floats equal up to the noise of a different batch layout."""
    if isinstance(a, dict):
        assert set(a) == set(b), path
        for k in a:
            _same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and not (isinstance(b, float) and math.isnan(a) and math.isnan(b)):
        assert b == pytest.approx(a, rel=1e-4, abs=1e-5), path
    else:
        assert a == b, path


def _scores(report):
    return {name: (r.rows, r.summary, r.plots.get("gates")) for name, r in report.editors.items()}


def test_chunk_bounds():
    assert chunk_bounds(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_bounds(5, None) == [(0, 5)] and chunk_bounds(4, 4) == [(0, 4)] and chunk_bounds(0, 3) == []
    with pytest.raises(ValueError):
        chunk_bounds(5, 0)


def test_chunks_give_one_pass_numbers_and_an_interrupted_run_resumes(tmp_path, monkeypatch):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    reqs = _requests()
    op = gate_operator(model, tok, reqs, open_=True)
    run = dict(baseline="unedited", progress=False)
    whole = evaluate(model, tok, reqs, op, **run)
    assert whole.summary["locality_states"]["n_unique_prompts"] == 4  # five locality prompts, one repeated

    real, calls = protocol.score_editor, []

    def interrupted_in_second_chunk(*args, **kw):
        calls.append(args[4][0].index)  # the first edit of the chunk being scored
        if len(calls) > 2:  # the two editors of chunk 0 went through
            raise KeyboardInterrupt
        return real(*args, **kw)

    parts = tmp_path / "parts"
    monkeypatch.setattr(protocol, "score_editor", interrupted_in_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        evaluate(model, tok, reqs, op, chunk_edits=2, parts_dir=parts, **run)
    assert sorted(p.name for p in parts.iterdir()) == ["chunk-00000.json.gz"]

    def counting(*args, **kw):
        calls.append(args[4][0].index)
        return real(*args, **kw)

    calls.clear()
    monkeypatch.setattr(protocol, "score_editor", counting)
    resumed = evaluate(model, tok, reqs, op, chunk_edits=2, parts_dir=parts, **run)
    assert calls == [2, 2]  # chunk 0 read back; chunk 1 scored by both editors, its edits numbered from 2
    _same(_scores(whole), _scores(resumed))
    assert [r["id"] for r in resumed.rows] == ["e0", "e1", "e2", "e3"]
    assert resumed.meta["settings"]["chunk_edits"] == 2

    # another target for an edit of chunk 0: that chunk is scored again, chunk 1 is read back
    calls.clear()
    changed = [
        EditRequest(
            reqs[0].prompt,
            "Paris",
            reqs[0].subject,
            rephrases=reqs[0].rephrases,
            locality=reqs[0].locality,
            portability=reqs[0].portability,
            id="e0",
        )
    ] + reqs[1:]
    again = evaluate(model, tok, changed, op, chunk_edits=2, parts_dir=parts, **run)
    assert calls == [0, 0]
    assert again.rows[0]["target"] == "Paris"


def test_a_fitted_baselines_fit_time_is_counted_once_over_the_chunks():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    reqs = _requests()
    fitted = UneditedEditor(1)
    fitted.fit_seconds = 7.5  # as fit_baseline records it
    report = evaluate(model, tok, reqs, baseline=[fitted], layer=1, chunk_edits=2, progress=False)
    assert report.meta["settings"]["chunk_edits"] == 2
    timings = report.editors["unedited"].info["timings"]
    assert timings["fit_s"] == 7.5 and timings["teacher_forced_s"] > 0
