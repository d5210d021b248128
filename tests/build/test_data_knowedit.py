"""Tests of the KnowEdit loaders (aloe_build.data.knowedit): nested ground-truth lists."""

from __future__ import annotations

import json
from pathlib import Path

import test_data_samples
from test_data_samples import _flat, _write_json

from aloe_build.data import PortabilityPrompt, load_edits

# Fixtures of test_data_samples, requested by name.
data_root = test_data_samples.data_root


def test_lists_of_lists_ground_truth_in_knowedit_recent(data_root: Path) -> None:
    path = data_root / "knowedit/recent_train.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    i = next(i for i, r in enumerate(raw) if len(r["locality"].get("Relation_Specificity", [])) > 1)
    nested = raw[i]["locality"]["Relation_Specificity"]
    assert isinstance(nested[1]["ground_truth"][0], list)  # the shape this test is about
    e = load_edits(path, limit=i + 1)[i]
    assert e.locality[1].ground_truth == _flat(nested[1]["ground_truth"])
    assert all(isinstance(g, str) for lp in e.locality for g in lp.ground_truth)


def test_lists_of_lists_ground_truth_in_a_file(tmp_path: Path) -> None:
    rec = {
        "subject": "Ingrida",
        "prompt": "The gender of Ingrida is",
        "target_new": "female",
        "ground_truth": [["male", "man"], ["male"]],
        "portability": {"Reasoning": [{"prompt": "Ingrida is a", "ground_truth": [["woman", "lady"]]}]},
        "locality": {
            "Relation_Specificity": [{"prompt": "The birthplace of Ingrida is", "ground_truth": [["Cēsis"]]}],
            "Forgetfulness": [{"prompt": "Ingrida's sex is", "ground_truth": "male"}],
        },
    }
    [e] = load_edits(_write_json(tmp_path / "k.json", [rec]))
    assert e.source == "knowedit_wikidata_counterfact"
    assert e.ground_truth == ("male", "man")
    assert e.portability == (PortabilityPrompt("Ingrida is a", ("woman", "lady"), "reasoning"),)
    assert [(lp.kind, lp.ground_truth) for lp in e.locality] == [
        ("relation_specificity", ("Cēsis",)),
        ("forgetfulness", ("male",)),
    ]
    assert e.id == "k-0"
