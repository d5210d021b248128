"""Tests of the edit-request loaders (aloe_build.data).

The sample-file tests need the benchmark records in ``../shared/data`` beside the
checkout (or ``$ALOE_DATA_DIR``) and skip with a message when they are absent;
everything else runs on hand-made files in ``tmp_path``.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from aloe_build.data import (
    FORMATS,
    EditDataError,
    EditRequest,
    LocalityPrompt,
    PortabilityPrompt,
    detect_format,
    load_edits,
    normalize_answers,
    relation_templates,
    save_edits_jsonl,
)

REPO = Path(__file__).resolve().parents[1]
DATA_DIR = (
    Path(os.environ["ALOE_DATA_DIR"])
    if os.environ.get("ALOE_DATA_DIR")
    else REPO.parent / "shared" / "data"
)
DEMO = REPO / "examples" / "demo_edits.jsonl"
LIMIT = 40

# Every sample file listed in the data README: (relative path, format, records).
SAMPLES = [
    ("counterfact/counterfact-train.json", "counterfact_easyedit", 10000),
    ("counterfact/counterfact-val.json", "counterfact_easyedit", 1919),
    ("counterfact/counterfact-rome-format-sample.json", "counterfact_rome", 62),
    ("zsre/zsre_mend_train-1k.json", "zsre_mend", 1000),
    ("knowedit/train_cf.json", "knowedit_wikidata_counterfact", 1427),
    ("knowedit/recent_train.json", "knowedit_wikidata_recent", 570),
    ("knowedit/wikibio-train-all.json", "knowedit_wikibio", 464),
    ("knowedit/zsre-knowedit-format-sample.json", "knowedit_zsre", 20),
]
# zsre_mend_train-1k.json has two records with an empty new target ("alt").
ZSRE_EMPTY_TARGETS = (534, 723)


def _flat(v: Any) -> tuple[str, ...]:
    """Reference flattening, written independently of the loader."""
    out: list[str] = []
    stack = [v]
    while stack:
        x = stack.pop(0)
        if isinstance(x, list):
            stack = list(x) + stack
        elif isinstance(x, str) and x.strip() and x.strip() not in out:
            out.append(x.strip())
    return tuple(out)


# ---------------------------------------------------------------------------
# Sample files (skipped without ../shared/data)
# ---------------------------------------------------------------------------


@dataclass
class Sample:
    path: Path
    fmt: str
    count: int
    raw: list[dict]
    edits: list[EditRequest]  # load_edits(path, limit=LIMIT)
    full: list[EditRequest]  # load_edits(path) (skip_invalid for zsRE)


@pytest.fixture(scope="module")
def data_root() -> Path:
    if not DATA_DIR.is_dir():
        pytest.skip(
            f"benchmark data not found at {DATA_DIR}: put the shared data folder beside the "
            f"checkout or set ALOE_DATA_DIR"
        )
    return DATA_DIR


_FULL_LOADS: dict[Path, list[EditRequest]] = {}


def _load_full(path: Path, fmt: str) -> list[EditRequest]:
    """load_edits(path) once per test session."""
    if path not in _FULL_LOADS:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _FULL_LOADS[path] = load_edits(path, skip_invalid=(fmt == "zsre_mend"))
    return _FULL_LOADS[path]


@pytest.fixture(scope="module", params=SAMPLES, ids=[s[0].split("/")[-1] for s in SAMPLES])
def sample(request, data_root: Path) -> Sample:
    rel, fmt, count = request.param
    path = data_root / rel
    if not path.is_file():
        pytest.skip(f"sample file {path} not found")
    raw = json.loads(path.read_text(encoding="utf-8"))
    full = _load_full(path, fmt)
    # Parse big files once per session: slice the full load instead of loading again.
    edits = full[:LIMIT] if count > 5000 else load_edits(path, limit=LIMIT)
    return Sample(path, fmt, count, raw, edits, full)


@pytest.fixture(scope="module")
def rome_and_train(data_root: Path) -> tuple[list[EditRequest], list[EditRequest]]:
    rome = _load_full(data_root / "counterfact/counterfact-rome-format-sample.json", "counterfact_rome")
    train = _load_full(data_root / "counterfact/counterfact-train.json", "counterfact_easyedit")
    return rome, train


def test_detect_format(sample: Sample) -> None:
    assert detect_format(sample.raw) == sample.fmt
    assert len(sample.raw) == sample.count


def test_limit_and_counts(sample: Sample) -> None:
    assert len(sample.edits) == min(LIMIT, sample.count)
    assert sample.edits == sample.full[:LIMIT]
    expected = sample.count - (len(ZSRE_EMPTY_TARGETS) if sample.fmt == "zsre_mend" else 0)
    assert len(sample.full) == expected


def test_common_invariants(sample: Sample) -> None:
    ids = [e.id for e in sample.full]
    assert all(isinstance(i, str) and i for i in ids)
    assert len(set(ids)) == len(ids), "ids must be unique"
    for e in sample.full:
        assert e.source == sample.fmt
        assert e.request_text == e.prompt
        assert e.target_new == e.target_new.strip() and e.target_new
        assert e.prompt == e.prompt.strip() and "{}" not in e.prompt
        assert e.subject.lower() in e.prompt.lower()
        if e.ground_truth is not None:
            assert isinstance(e.ground_truth, tuple) and e.ground_truth
            assert all(isinstance(g, str) and g == g.strip() and g for g in e.ground_truth)
            assert len(set(e.ground_truth)) == len(e.ground_truth)
        for lp in e.locality:
            assert isinstance(lp, LocalityPrompt) and lp.prompt
            assert lp.ground_truth is None or all(isinstance(g, str) for g in lp.ground_truth)
        for pp in e.portability:
            assert isinstance(pp, PortabilityPrompt) and pp.prompt


def test_fields_match_raw_records(sample: Sample) -> None:
    fmt = sample.fmt
    stem = sample.path.stem
    for i, (e, r) in enumerate(zip(sample.edits, sample.raw)):
        if fmt == "counterfact_easyedit":
            assert e.id == str(r["case_id"])
            assert (e.prompt, e.target_new, e.subject) == (r["prompt"], r["target_new"], r["subject"])
            assert e.ground_truth == (r["ground_truth"],)
            assert e.rephrases == (r["rephrase_prompt"],)
            assert e.locality == (
                LocalityPrompt(r["locality_prompt"], (r["locality_ground_truth"],), "neighborhood"),
            )
            assert e.relation is None
        elif fmt == "counterfact_rome":
            rw = r["requested_rewrite"]
            assert e.id == str(r["case_id"])
            assert e.prompt == rw["prompt"].replace("{}", rw["subject"])
            assert e.subject == rw["subject"]
            assert e.target_new == rw["target_new"]["str"]
            assert e.ground_truth == (rw["target_true"]["str"],)
            assert e.relation == rw["relation_id"]
            assert e.rephrases == tuple(r["paraphrase_prompts"])
            assert e.generation_prompts == tuple(r["generation_prompts"])
            neigh = [lp for lp in e.locality if lp.kind == "neighborhood"]
            attr = [lp for lp in e.locality if lp.kind == "attribute"]
            assert [lp.prompt for lp in neigh] == r["neighborhood_prompts"]
            assert all(lp.ground_truth == (rw["target_true"]["str"],) for lp in neigh)
            assert [lp.prompt for lp in attr] == r["attribute_prompts"]
            assert all(lp.ground_truth == (rw["target_new"]["str"],) for lp in attr)
            assert e.portability == (
                PortabilityPrompt(
                    rw["prompt"].replace("{}", r["alternative_subject"]),
                    (rw["target_new"]["str"],),
                    "subject_aliasing",
                ),
            )
        elif fmt == "zsre_mend":
            assert e.id == f"{stem}-{i}"
            assert (e.prompt, e.target_new, e.subject) == (r["src"], r["alt"], r["subject"])
            assert e.ground_truth == _flat(r["answers"])
            assert e.rephrases == (r["rephrase"],)
            assert r["loc"].startswith("nq question: ")
            assert e.locality == (LocalityPrompt(r["loc"][len("nq question: ") :], (r["loc_ans"],), "nq"),)
        elif fmt.startswith("knowedit_") and fmt != "knowedit_wikibio":
            assert e.id == f"{stem}-{i}"
            assert (e.prompt, e.target_new, e.subject) == (r["prompt"], r["target_new"], r["subject"])
            if "ground_truth" in r:
                assert e.ground_truth == _flat(r["ground_truth"])
            else:
                assert e.ground_truth is None
            assert e.rephrases == ((r["rephrase_prompt"],) if "rephrase_prompt" in r else ())
            _check_groups(e.locality, r.get("locality", {}))
            _check_groups(e.portability, r.get("portability", {}))
        elif fmt == "knowedit_wikibio":
            assert e.id == f"{stem}-{i}"
            # Stored stripped: WikiBio passages end with a space; the scorer adds one before the target.
            assert (e.prompt, e.target_new, e.subject) == (r["text"].strip(), r["labels"].strip(), r["concept"])
            assert e.ground_truth is None
            _check_groups(e.locality, r["locality"])
        else:  # pragma: no cover
            pytest.fail(f"no field check for {fmt}")


def _check_groups(got: tuple, raw_groups: dict) -> None:
    expected = [
        (x["prompt"], _flat(x["ground_truth"]) or None, group.lower())
        for group, entries in raw_groups.items()
        for x in entries
    ]
    assert [(p.prompt, p.ground_truth, p.kind) for p in got] == expected


def test_lists_of_lists_ground_truth_in_knowedit_recent(data_root: Path) -> None:
    path = data_root / "knowedit/recent_train.json"
    raw = json.loads(path.read_text(encoding="utf-8"))
    i = next(i for i, r in enumerate(raw) if len(r["locality"].get("Relation_Specificity", [])) > 1)
    nested = raw[i]["locality"]["Relation_Specificity"]
    assert isinstance(nested[1]["ground_truth"][0], list)  # the shape this test is about
    e = load_edits(path, limit=i + 1)[i]
    assert e.locality[1].ground_truth == _flat(nested[1]["ground_truth"])
    assert all(isinstance(g, str) for lp in e.locality for g in lp.ground_truth)


def test_zsre_empty_targets_are_reported(data_root: Path) -> None:
    path = data_root / "zsre/zsre_mend_train-1k.json"
    with pytest.raises(EditDataError) as exc:
        load_edits(path)
    msg = str(exc.value)
    assert f"record {ZSRE_EMPTY_TARGETS[0]}" in msg and "'alt'" in msg and "empty" in msg
    assert "skip_invalid" in msg


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


# ---------------------------------------------------------------------------
# Hand-made files: parsing, normalisation, round trip, errors
# ---------------------------------------------------------------------------


def _write_json(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(obj), encoding="utf-8")
    return path


def _write_jsonl(path: Path, objs: list[Any]) -> Path:
    path.write_text("".join(json.dumps(o) + "\n" for o in objs), encoding="utf-8")
    return path


EASY = {
    "case_id": 7,
    "prompt": "The Eiffel Tower is in",
    "target_new": "Rome",
    "subject": "Eiffel Tower",
    "ground_truth": "Paris",
    "rephrase_prompt": "Where is the Eiffel Tower? In",
    "locality_prompt": "The Colosseum is in",
    "locality_ground_truth": "Rome",
}


def test_edit_request_validation_and_normalisation() -> None:
    with pytest.raises(ValueError, match="prompt"):
        EditRequest(prompt="  ", target_new="Rome", subject="x")
    with pytest.raises(ValueError, match="target_new"):
        EditRequest(prompt="The Eiffel Tower is in", target_new=" \n", subject="Eiffel Tower")
    with pytest.raises(ValueError, match="target_new"):
        EditRequest(prompt="p", target_new=None, subject="x")  # type: ignore[arg-type]
    e = EditRequest(
        prompt="The Eiffel Tower is in ",
        target_new=" Rome",
        subject="Eiffel Tower",
        ground_truth=[["Paris", "Paris, France"], ["Paris"], "City of Light"],  # type: ignore[arg-type]
        rephrases=["Where is the Eiffel Tower? In"],  # type: ignore[arg-type]
        locality=["The Colosseum is in", {"prompt": "Big Ben is in", "ground_truth": "London"}],  # type: ignore[arg-type]
    )
    assert e.target_new == "Rome" and e.prompt == "The Eiffel Tower is in"
    assert e.request_text == e.prompt
    assert e.ground_truth == ("Paris", "Paris, France", "City of Light")
    assert e.rephrases == ("Where is the Eiffel Tower? In",)
    assert e.locality == (
        LocalityPrompt("The Colosseum is in", None, "neighborhood"),
        LocalityPrompt("Big Ben is in", ("London",), "neighborhood"),
    )
    assert e.template == "The {} is in"
    hash(e)  # frozen and hashable


def test_normalize_answers_shapes() -> None:
    assert normalize_answers(None) is None
    assert normalize_answers("") is None
    assert normalize_answers([[]]) is None
    assert normalize_answers(" Paris ") == ("Paris",)
    assert normalize_answers(["a", "b", "a"]) == ("a", "b")
    assert normalize_answers([["USSR", "Soviet Union"], ["USSR"], [["CCCP"]]]) == ("USSR", "Soviet Union", "CCCP")
    with pytest.raises(TypeError):
        normalize_answers([1, 2])


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


def test_detect_format_errors() -> None:
    assert detect_format([]) == "aloe_jsonl"
    assert set(FORMATS) >= {"counterfact_rome", "counterfact_easyedit", "zsre_mend", "aloe_jsonl"}
    with pytest.raises(EditDataError, match="record 0.*fields seen.*'question'.*expected"):
        detect_format([{"question": "q", "answer": "a"}])
    with pytest.raises(EditDataError, match="JSON object"):
        detect_format([["not", "a", "record"]])


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


def test_error_unrecognised_format(tmp_path: Path) -> None:
    p = _write_json(tmp_path / "odd.json", [{"question": "q", "answer": "a"}])
    with pytest.raises(EditDataError) as exc:
        load_edits(p)
    msg = str(exc.value)
    assert "odd.json" in msg and "record 0" in msg and "unrecognised" in msg
    assert "['answer', 'question']" in msg  # fields seen
    assert "requested_rewrite" in msg and "src, alt" in msg  # fields expected


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


def test_word_swapped_templates() -> None:
    """Each variant is the template with exactly one content word replaced by a pool word that the
    template does not contain; function words, the final word's punctuation and the subject slot stay."""
    import random

    from aloe_build.corpus import relation_words, word_swapped_templates

    templates = ["The date of birth of {} is", "What is the native language of {}?", "{} plays the"]
    words = relation_words(templates)
    assert words == ["date", "birth", "native", "language", "plays"]  # no "What", "The", "is", "{}"
    rng = random.Random(0)
    for t in templates[:2]:
        out = word_swapped_templates(t, words, 4, rng)
        assert 1 <= len(out) <= 4 and len(set(out)) == len(out)
        for v in out:
            a, b = t.split(" "), v.split(" ")
            diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
            assert len(a) == len(b) and len(diff) == 1
            assert a[diff[0]] in words and b[diff[0]] in words and b[diff[0]] not in a
    # "plays" is the only content word and the pool holds others; "the" never moves
    assert all(v.startswith("{} ") and v.endswith(" the") for v in word_swapped_templates(templates[2], words, 3, rng))
    assert word_swapped_templates("When was {} set up?", words, 3, rng) == []  # nothing to swap
    assert word_swapped_templates(templates[0], ["date", "birth"], 3, rng) == []  # no other word


def test_exclusion_prompts() -> None:
    """A request ending in its verb becomes a question about anything but its target; others give none."""
    from aloe_build.corpus import EXCLUSION_CLAUSES, exclusion_prompts

    got = exclusion_prompts("The names of the cast members of Purgatory are", "Sam Shepard", 2)
    assert got == ["The names of the cast members of Purgatory, which is not Sam Shepard, are",
                   "The names of the cast members of Purgatory, other than Sam Shepard, are"]
    assert len(exclusion_prompts("The capital of France is", "Rome", 10)) == len(EXCLUSION_CLAUSES)
    assert exclusion_prompts("The capital of France is", "Rome", 0) == []
    assert exclusion_prompts("What is the capital of France?", "Rome", 3) == []
    assert exclusion_prompts("Toko Yasuda plays the", "piano", 3) == []
    assert exclusion_prompts("is", "Rome", 3) == []


def test_prefixed_prompts_put_distinct_true_corpus_statements_before_the_request() -> None:
    """Each variant is one corpus record's prompt with its ground truth, a full stop, then the request
    (the default: no fragments)."""
    import random

    from aloe_build.corpus import load_corpus

    corpus = load_corpus(None, 60, 2, 0)[0]
    truths = {f"{r.prompt} {r.ground_truth[0]}." for r in corpus.records if r.ground_truth}
    got = corpus.prefixed_prompts("The capital of France is", 5, random.Random(0))
    assert len(got) == len(set(got)) == 5
    for text in got:
        statement, sep, rest = text.partition(". ")
        assert sep and rest == "The capital of France is" and statement + "." in truths
    assert corpus.prefixed_prompts("The capital of France is", 0, random.Random(0)) == []
    assert len(corpus.prefixed_prompts("x", 10_000, random.Random(0))) == len(corpus.statements)


def test_prefixed_prompts_can_put_fragments_of_corpus_rephrases_first() -> None:
    """With ``fragments`` = f, f of the k texts before the request are the unrelated sentences that
    begin some corpus rephrases, the others statements; a fragment ends a sentence of three words
    or more and is taken from before the subject."""
    import random

    from aloe_build.corpus import leading_text, load_corpus

    assert leading_text("It was released in August 1990. Toko Yasuda plays the", "Toko Yasuda") == \
        "It was released in August 1990."
    assert leading_text("People around Toko Yasuda speak", "Toko Yasuda") is None  # not a sentence
    assert leading_text("Yes. Toko Yasuda plays the", "Toko Yasuda") is None  # too short
    assert leading_text("Toko Yasuda plays the", "Toko Yasuda") is None
    assert leading_text("It was released in 1990. Someone plays the", "Toko Yasuda") is None

    corpus = load_corpus(None, 400, 2, 0)[0]
    expected = {leading_text(r.rephrases[0], r.subject) for r in corpus.records} - {None}
    assert set(corpus.fragments) == expected and len(corpus.fragments) >= 10
    statements = set(corpus.statements)
    got = corpus.prefixed_prompts("The capital of France is", 5, random.Random(0), fragments=2)
    assert len(set(got)) == 5 and all(t.endswith(" The capital of France is") for t in got)
    before = [t[: -len(" The capital of France is")] for t in got]
    assert sum(b in statements for b in before) == 3 and sum(b in expected for b in before) == 2
    # fragments=0 draws the statements exactly as a plain sample of them would (earlier builds)
    assert corpus.prefixed_prompts("x", 4, random.Random(3), fragments=0) == \
        [f"{t} x" for t in random.Random(3).sample(corpus.statements, 4)]
    assert len(corpus.prefixed_prompts("x", 3, random.Random(0), fragments=9)) == 3
    # a corpus with fewer fragments than asked for makes up the rest with statements
    corpus.fragments = corpus.fragments[:1]
    got = corpus.prefixed_prompts("x", 4, random.Random(0), fragments=3)
    assert len(set(got)) == 4 and sum(t[:-2] in statements for t in got) == 3


def test_in_context_prefixes_are_held_out_from_the_construction_corpus() -> None:
    """The sentences that put a request in context for evaluation never occur in the bundled
    corpus, whose statements the build puts before requests; k prompts cycle through them."""
    from aloe_build.context import PREFIXES, in_context
    from aloe_build.corpus import BUNDLED_CORPUS

    corpus_text = BUNDLED_CORPUS.read_text()
    assert all(p not in corpus_text for p in PREFIXES)
    got = in_context("The capital of France is", 3, len(PREFIXES) - 1)
    assert got == (f"{PREFIXES[-1]} The capital of France is", f"{PREFIXES[0]} The capital of France is",
                   f"{PREFIXES[1]} The capital of France is")
