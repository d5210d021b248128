"""Tests of relation-template mining (aloe_build.data.templates)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import test_data_samples
from test_data_samples import DATA_DIR, Sample

from aloe_build.data import load_edits, relation_templates

# Fixtures of test_data_samples, requested by name.
data_root = test_data_samples.data_root
rome_and_train = test_data_samples.rome_and_train
sample = test_data_samples.sample


def test_relation_templates_from_rome(rome_and_train) -> None:
    rome, _ = rome_and_train
    groups = relation_templates(rome)
    assert set(groups) == {e.relation for e in rome}
    assert "{} specializes in" in groups["P101"]
    for e in rome:
        assert e.template in groups[e.relation]
        assert e.template.replace("{}", e.subject) == e.prompt
    for templates in groups.values():
        assert len(templates) == len(set(templates))
        assert all(t.count("{}") == 1 for t in templates)


def test_relation_templates_grouping(sample: Sample) -> None:
    groups = relation_templates(sample.edits)
    assert groups
    for key, templates in groups.items():
        if sample.fmt == "counterfact_rome":  # relation ids known: grouped by them
            assert key.startswith("P") and templates
        else:  # unknown: linked through rephrases and locality prompts, keyed by the first template
            assert templates[0] == key
        assert all("{}" in t for t in templates)
    grouped = [t for ts in groups.values() for t in ts]
    assert len(grouped) == len(set(grouped)), "a template in two groups"


# CounterFact states these location relations with the same templates ("{} is located in").
_SHARED_TEMPLATE_RELATIONS = {"P131", "P17", "P30", "P276"}


def test_relation_linking_recovers_relation_ids() -> None:
    """Without relation ids, linking templates through rephrases and locality prompts recovers
    CounterFact's relations: no group mixes relations (beyond those that share templates)."""
    path = DATA_DIR / "counterfact" / "counterfact-rome-format-sample.json"
    if not path.is_file():
        pytest.skip(f"benchmark data not found at {path} (set ALOE_DATA_DIR)")
    edits = load_edits(path)
    relation = {e.template: e.relation for e in edits if e.template}
    groups = relation_templates([replace(e, relation=None) for e in edits])
    assert len(groups) >= 5
    linked = 0
    for templates in groups.values():
        rels = {relation[t] for t in templates}
        assert len(rels) == 1 or rels <= _SHARED_TEMPLATE_RELATIONS, (rels, templates)
        linked += len(templates) > 1
    assert linked >= 4  # templates really were linked, not left one per group
