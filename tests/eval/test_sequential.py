"""The lifelong protocol on a tiny model: batches built then appended, scored after each, resumable."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_models import tiny_model, tiny_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "build"))
from eval_helpers import tiny_requests  # noqa: E402
from test_pipeline import _tiny_cfg  # noqa: E402

from aloe_eval.sequential import batch_bounds, run_sequential  # noqa: E402
from aloe_kernels import AloeOperator  # noqa: E402


def test_batch_bounds():
    assert batch_bounds(839, 8) == [(0, 105), (105, 210), (210, 315), (315, 420), (420, 525), (525, 630), (630, 735), (735, 839)]
    assert batch_bounds(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError):
        batch_bounds(2, 3)


def test_sequential_builds_appends_scores_and_resumes(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    requests = tiny_requests()
    result = run_sequential(
        model, tok, requests, 2, tmp_path / "seq", config=_tiny_cfg(tmp_path), batch_size=4, progress=False, log=None
    )
    steps = result["steps"]
    assert [s["edits"] for s in steps] == [2, 3] and [s["operator_n"] for s in steps] == [2, 3]
    for s in steps:
        assert all(0.0 <= s[k] <= 1.0 for k in ("efficacy", "generalization", "locality", "first_batch_efficacy"))
    op0, op1 = AloeOperator.load(tmp_path / "seq" / "op0"), AloeOperator.load(tmp_path / "seq" / "op1")
    assert op1.ids[:2] == op0.ids and (op1.addresses[:2] == op0.addresses).all()
    assert (tmp_path / "seq" / "retention.png").stat().st_size > 0
    assert json.loads((tmp_path / "seq" / "sequential.json").read_text()) == result
    stamp = (tmp_path / "seq" / "op1" / "aloe_operator.safetensors").stat().st_mtime_ns
    again = run_sequential(model, tok, requests, 2, tmp_path / "seq", config=_tiny_cfg(tmp_path), progress=False, log=None)
    assert again == result and (tmp_path / "seq" / "op1" / "aloe_operator.safetensors").stat().st_mtime_ns == stamp
