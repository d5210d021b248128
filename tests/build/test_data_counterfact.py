"""Tests of the CounterFact loaders (aloe_build.data.counterfact): ROME and EasyEdit layouts."""

from __future__ import annotations

import test_data_samples

# Fixtures of test_data_samples, requested by name.
data_root = test_data_samples.data_root
rome_and_train = test_data_samples.rome_and_train


def test_rome_and_easyedit_counterfact_agree(rome_and_train) -> None:
    rome, train = rome_and_train
    by_id = {e.id: e for e in train}
    common = [e for e in rome if e.id in by_id]
    assert len(common) >= 10
    for e in common:
        t = by_id[e.id]
        assert (e.prompt, e.target_new, e.subject, e.ground_truth) == (
            t.prompt,
            t.target_new,
            t.subject,
            t.ground_truth,
        )
