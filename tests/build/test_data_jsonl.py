"""Tests of our own JSONL format (aloe_build.data.jsonl): round trips and the demo edits."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import test_data_samples
from test_data_samples import DEMO, Sample, _write_jsonl

from aloe_build.data import (
    EditRequest,
    LocalityPrompt,
    PortabilityPrompt,
    detect_format,
    load_edits,
    relation_templates,
    save_edits_jsonl,
)

# Fixtures of test_data_samples, requested by name.
data_root = test_data_samples.data_root
sample = test_data_samples.sample


def test_sample_round_trip(sample: Sample, tmp_path: Path) -> None:
    out = save_edits_jsonl(sample.edits, tmp_path / "rt.jsonl")
    back = load_edits(out)
    assert back == sample.edits


# ---------------------------------------------------------------------------
# Demo edits
# ---------------------------------------------------------------------------


def test_demo_edits_file() -> None:
    edits = load_edits(DEMO)
    assert len(edits) >= 25
    assert len({e.id for e in edits}) == len(edits)
    subjects = [e.subject.lower() for e in edits]
    for e in edits:
        assert e.source == "aloe_jsonl"
        assert e.subject and e.subject in e.prompt
        assert e.ground_truth and e.target_new not in e.ground_truth
        assert e.rephrases and all(r != e.prompt for r in e.rephrases)
        assert e.locality and all(lp.ground_truth for lp in e.locality)
        assert e.relation
        for lp in e.locality:  # controls are about subjects no edit touches
            assert not any(s in lp.prompt.lower() for s in subjects), lp.prompt
    groups = relation_templates(edits)
    assert "The capital of {} is" in groups["P36"]


def test_our_jsonl_round_trip(tmp_path: Path) -> None:
    edits = [
        EditRequest(
            prompt="The Eiffel Tower is located in the city of",
            target_new="Rome",
            subject="Eiffel Tower",
            ground_truth=("Paris", "Paris, France"),
            rephrases=("The Eiffel Tower stands in the city of",),
            locality=(LocalityPrompt("The capital of Canada is", ("Ottawa",), "unrelated"),),
            portability=(PortabilityPrompt("The Eiffel Tower is in the country of", ("Italy",), "reasoning"),),
            generation_prompts=("The Eiffel Tower is famous for",),
            id="e1",
            relation="P131",
            source="counterfact_easyedit",
        ),
        EditRequest(prompt="Big Ben is in", target_new="Dublin", subject="Big Ben", id="e2"),
    ]
    p = save_edits_jsonl(edits, tmp_path / "sub" / "edits.jsonl")
    assert p.is_file() and len(p.read_text(encoding="utf-8").splitlines()) == 2
    back = load_edits(p)
    assert back[0] == edits[0]
    assert back[1] == replace(edits[1], source="aloe_jsonl")  # no source stored -> the format name
    # Bare locality strings and no id in hand-written JSONL.
    q = _write_jsonl(
        tmp_path / "hand.jsonl",
        [{"prompt": "The capital of Japan is", "target_new": "Seoul", "subject": "Japan", "locality": ["2+2="]}],
    )
    [h] = load_edits(q)
    assert h.id == "hand-0" and h.locality == (LocalityPrompt("2+2=", None, "neighborhood"),)
    assert detect_format([{"prompt": "p", "target_new": "t", "subject": "s"}]) == "aloe_jsonl"
