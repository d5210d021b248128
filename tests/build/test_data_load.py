"""Tests of reading edit files and of load_edits (aloe_build.data.load): limits, JSON wrappers,
every format from hand-made records, and the error paths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_data_samples
from test_data_samples import EASY, LIMIT, ZSRE_EMPTY_TARGETS, Sample, _write_json, _write_jsonl

from aloe_build.data import EditDataError, LocalityPrompt, load_edits

# Fixtures of test_data_samples, requested by name.
data_root = test_data_samples.data_root
sample = test_data_samples.sample


def test_limit_and_counts(sample: Sample) -> None:
    assert len(sample.edits) == min(LIMIT, sample.count)
    assert sample.edits == sample.full[:LIMIT]
    expected = sample.count - (len(ZSRE_EMPTY_TARGETS) if sample.fmt == "zsre_mend" else 0)
    assert len(sample.full) == expected


def test_each_format_from_hand_made_records(tmp_path: Path) -> None:
    rome = {
        "case_id": 3,
        "requested_rewrite": {
            "prompt": "The mother tongue of {} is",
            "relation_id": "P103",
            "subject": "Danielle Darrieux",
            "target_new": {"str": "English", "id": "Q1860"},
            "target_true": {"str": "French", "id": "Q150"},
        },
        "paraphrase_prompts": ["Danielle Darrieux speaks"],
        "neighborhood_prompts": ["The mother tongue of Jean Gabin is"],
        "attribute_prompts": ["The mother tongue of Tony Blair is"],
        "generation_prompts": ["Danielle Darrieux's mother tongue is"],
    }
    [e] = load_edits(_write_json(tmp_path / "rome.json", [rome]))
    assert e.source == "counterfact_rome" and e.prompt == "The mother tongue of Danielle Darrieux is"
    assert (e.target_new, e.ground_truth, e.relation, e.id) == ("English", ("French",), "P103", "3")
    assert [(lp.kind, lp.ground_truth) for lp in e.locality] == [
        ("neighborhood", ("French",)),
        ("attribute", ("English",)),
    ]

    zsre = {
        "subject": "UniFirst",
        "src": "What is the product made by UniFirst?",
        "alt": "unmanned aircraft",
        "answers": ["uniform"],
        "rephrase": "What will be the product of UniFirst?",
        "loc": "nq question: who plays the cat in the hat movie",
        "loc_ans": "Mike Myers",
    }
    [z] = load_edits(_write_json(tmp_path / "z.json", [zsre]))
    assert z.source == "zsre_mend" and z.target_new == "unmanned aircraft"
    assert z.locality == (LocalityPrompt("who plays the cat in the hat movie", ("Mike Myers",), "nq"),)

    bio = {"text": "This is about rick mahler.", "labels": "He pitched.", "concept": "rick mahler", "locality": {}}
    [b] = load_edits(_write_json(tmp_path / "b.json", [bio]))
    assert (b.source, b.prompt, b.target_new, b.subject) == (
        "knowedit_wikibio",
        "This is about rick mahler.",
        "He pitched.",
        "rick mahler",
    )


def test_json_wrappers_and_jsonl_in_json(tmp_path: Path) -> None:
    [a] = load_edits(_write_json(tmp_path / "w.json", {"data": [EASY]}))
    assert a.source == "counterfact_easyedit" and a.id == "7"
    [b] = load_edits(_write_json(tmp_path / "one.json", EASY))  # a single record
    assert b == a
    p = tmp_path / "lines.json"  # JSON Lines in a .json file
    p.write_text(json.dumps(EASY) + "\n" + json.dumps({**EASY, "case_id": 8}) + "\n", encoding="utf-8")
    assert [e.id for e in load_edits(p)] == ["7", "8"]
    assert load_edits(_write_json(tmp_path / "empty.json", [])) == []


def test_limit(tmp_path: Path) -> None:
    recs = [{**EASY, "case_id": i} for i in range(5)]
    p = _write_json(tmp_path / "l.json", recs)
    assert [e.id for e in load_edits(p, limit=2)] == ["0", "1"]
    assert load_edits(p, limit=0) == []
    assert len(load_edits(p, limit=99)) == 5
    with pytest.raises(ValueError, match="limit"):
        load_edits(p, limit=-1)


def test_gzipped_files_read_as_their_inner_format_and_hash_as_their_content(tmp_path: Path) -> None:
    import gzip

    from aloe_build.checkpoints import file_sha256

    recs = [{**EASY, "case_id": i} for i in range(3)]
    plain = _write_jsonl(tmp_path / "r.jsonl", recs)
    packed = tmp_path / "r.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    assert load_edits(packed) == load_edits(plain)
    assert file_sha256(packed) == file_sha256(plain)  # caches keyed on a corpus survive its compression
    json_packed = tmp_path / "r.json.gz"
    json_packed.write_bytes(gzip.compress(json.dumps(recs).encode()))
    assert load_edits(json_packed) == load_edits(plain)
    broken = tmp_path / "b.jsonl.gz"
    broken.write_bytes(b"not gzip")
    with pytest.raises(EditDataError, match="not a readable gzip file"):
        load_edits(broken)


# --- error paths --------------------------------------------------------------


def test_error_missing_file(tmp_path: Path) -> None:
    with pytest.raises(EditDataError, match="not found") as exc:
        load_edits(tmp_path / "nope.json")
    assert "nope.json" in str(exc.value)
    assert isinstance(exc.value, ValueError)


def test_error_bad_json(tmp_path: Path) -> None:
    p = tmp_path / "bad.json"
    p.write_text('[\n  {"prompt": "a",\n  oops\n]', encoding="utf-8")
    with pytest.raises(EditDataError, match=r"bad\.json: invalid JSON at line 3"):
        load_edits(p)


def test_error_bad_jsonl_names_the_line(tmp_path: Path) -> None:
    p = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "p", "target_new": "t", "subject": "s"})
    p.write_text(good + "\n\n" + '{"prompt": "p", "target_new": \n', encoding="utf-8")
    with pytest.raises(EditDataError, match=r"bad\.jsonl: line 3: invalid JSON"):
        load_edits(p)


def test_error_missing_required_field(tmp_path: Path) -> None:
    bad = {k: v for k, v in EASY.items() if k != "target_new"}
    p = _write_json(tmp_path / "m.json", [EASY, {**bad, "case_id": 9}])
    with pytest.raises(EditDataError, match=r"record 1 \[id 9\]: missing required field 'target_new'"):
        load_edits(p)
    # ... and in JSONL, the line as well.
    q = _write_jsonl(tmp_path / "m.jsonl", [{"prompt": "p", "target_new": "t", "subject": "s"}, {"prompt": "p"}])
    with pytest.raises(EditDataError, match=r"record 1 \(line 2\) \[id m-1\]: missing required field 'target_new'"):
        load_edits(q)


def test_error_empty_target(tmp_path: Path) -> None:
    p = _write_json(tmp_path / "e.json", [EASY, {**EASY, "case_id": 11, "target_new": "  "}])
    with pytest.raises(EditDataError, match=r"record 1 \[id 11\]: field 'target_new' is empty"):
        load_edits(p)
    zs = {"subject": "X", "src": "What is X?", "alt": "", "answers": ["y"], "rephrase": "X?", "loc": "", "loc_ans": ""}
    with pytest.raises(EditDataError, match=r"record 0 \[id z-0\]: field 'alt' \(target_new\) is empty"):
        load_edits(_write_json(tmp_path / "z.json", [zs]))


def test_error_bad_records_and_skip_invalid(tmp_path: Path) -> None:
    p = _write_json(tmp_path / "d.json", [EASY, EASY])
    with pytest.raises(EditDataError, match="duplicate id '7'"):
        load_edits(p)
    q = _write_json(tmp_path / "n.json", [EASY, "just a string"])
    with pytest.raises(EditDataError, match="record 1: expected a JSON object"):
        load_edits(q)
    r = _write_json(tmp_path / "s.json", [EASY, {**EASY, "case_id": 8, "target_new": ""}, {**EASY, "case_id": 9}])
    with pytest.warns(UserWarning, match="skipped 1 invalid record"):
        assert [e.id for e in load_edits(r, skip_invalid=True)] == ["7", "9"]
    u = _write_jsonl(tmp_path / "u.jsonl", [{"prompt": "p", "target_new": "t", "subject": "s", "rephrase": "x"}])
    with pytest.raises(EditDataError, match="unrecognised"):
        load_edits(u)  # 'rephrase' is no field of ours (a typo of 'rephrases')
    w = _write_json(tmp_path / "w.json", {"train": [EASY], "test": [EASY]})
    with pytest.raises(EditDataError, match="several lists"):
        load_edits(w)
    with pytest.raises(EditDataError, match="JSON str"):
        load_edits(_write_json(tmp_path / "s2.json", "hello"))
