"""Tests of the MEND zsRE loader (aloe_build.data.zsre)."""

from __future__ import annotations

from pathlib import Path

import pytest
import test_data_samples
from test_data_samples import ZSRE_EMPTY_TARGETS

from aloe_build.data import EditDataError, load_edits

# Fixtures of test_data_samples, requested by name.
data_root = test_data_samples.data_root


def test_zsre_empty_targets_are_reported(data_root: Path) -> None:
    path = data_root / "zsre/zsre_mend_train-1k.json"
    with pytest.raises(EditDataError) as exc:
        load_edits(path)
    msg = str(exc.value)
    assert f"record {ZSRE_EMPTY_TARGETS[0]}" in msg and "'alt'" in msg and "empty" in msg
    assert "skip_invalid" in msg
