"""Tests of the edit-request loaders (aloe_build.data) on the benchmark sample files,
and the fixtures and helpers the other ``test_data_*`` modules share.

The sample-file tests need the benchmark records in ``../shared/data`` beside the
checkout (or ``$ALOE_DATA_DIR``) and skip with a message when they are absent;
everything else runs on hand-made files in ``tmp_path``. The tests here check every
sample file against its raw records, whatever the format; the tests of one format
are in ``test_data_<format>.py``, those of file reading and format detection in
``test_data_load.py`` and ``test_data_detect.py``.
"""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from aloe_build.data import EditRequest, LocalityPrompt, PortabilityPrompt, load_edits

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(os.environ["ALOE_DATA_DIR"]) if os.environ.get("ALOE_DATA_DIR") else REPO.parent / "shared" / "data"
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
            f"benchmark data not found at {DATA_DIR}: put the shared data folder beside the checkout or set ALOE_DATA_DIR"
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
            assert e.locality == (LocalityPrompt(r["locality_prompt"], (r["locality_ground_truth"],), "neighborhood"),)
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
        (x["prompt"], _flat(x["ground_truth"]) or None, group.lower()) for group, entries in raw_groups.items() for x in entries
    ]
    assert [(p.prompt, p.ground_truth, p.kind) for p in got] == expected


# ---------------------------------------------------------------------------
# Hand-made files (helpers for the other test_data_* modules)
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
