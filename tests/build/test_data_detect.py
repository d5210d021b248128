"""Tests of format detection (aloe_build.data.detect), on the sample files and hand-made records."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_data_samples
from test_data_samples import Sample, _write_json

from aloe_build.data import FORMATS, EditDataError, detect_format, load_edits

# Fixtures of test_data_samples, requested by name.
data_root = test_data_samples.data_root
sample = test_data_samples.sample


def test_detect_format(sample: Sample) -> None:
    assert detect_format(sample.raw) == sample.fmt
    assert len(sample.raw) == sample.count


def test_detect_format_errors() -> None:
    assert detect_format([]) == "aloe_jsonl"
    assert set(FORMATS) >= {"counterfact_rome", "counterfact_easyedit", "zsre_mend", "aloe_jsonl"}
    with pytest.raises(EditDataError, match="record 0.*fields seen.*'question'.*expected"):
        detect_format([{"question": "q", "answer": "a"}])
    with pytest.raises(EditDataError, match="JSON object"):
        detect_format([["not", "a", "record"]])


def test_error_unrecognised_format(tmp_path: Path) -> None:
    p = _write_json(tmp_path / "odd.json", [{"question": "q", "answer": "a"}])
    with pytest.raises(EditDataError) as exc:
        load_edits(p)
    msg = str(exc.value)
    assert "odd.json" in msg and "record 0" in msg and "unrecognised" in msg
    assert "['answer', 'question']" in msg  # fields seen
    assert "requested_rewrite" in msg and "src, alt" in msg  # fields expected
