"""The development stream at scale: disjoint from the construction corpus, in source order."""

from __future__ import annotations

import json

from aloe_build.corpus import default_corpus_path
from aloe_build.data import EditRequest, load_edits
from aloe_eval.streams import disjoint_stream


def _r(i, prompt, target, subject):
    return EditRequest(prompt=prompt, target_new=target, subject=subject, id=i)


def test_disjoint_stream_drops_each_overlap_and_keeps_order():
    corpus = [_r("1", "Paris is in", "Italy", "Paris"), _r("2", "Rome is in", "Spain", "Rome")]
    val = [
        _r("10", "Berlin is in", "Japan", "Berlin"),  # kept
        _r("1", "Oslo is in", "Peru", "Oslo"),  # case id of the corpus
        _r("11", "Paris is in", "Chile", "Paris"),  # (subject, prompt) pair of the corpus
        _r("12", "Berlin is in", "Chad", "Berlin"),  # repeats an earlier prompt
    ]
    train = [
        _r("13", "Rome is in", "Spain", "Rome"),  # the corpus record itself under another id
        _r("10", "Vienna is in", "Laos", "Vienna"),  # an id already in the stream
        _r("14", "Lima is in", "Fiji", "Lima"),  # kept
    ]
    stream, report = disjoint_stream([("val", val), ("train", train)], corpus)
    assert [r.id for r in stream] == ["10", "14"]
    assert report.sources == {"val": 4, "train": 3}
    assert report.dropped == {
        "case_id_in_corpus": 1,
        "subject_prompt_pair_in_corpus": 1,
        "repeated_prompt": 1,
        "record_in_corpus": 1,
        "repeated_id": 1,
    }
    assert report.kept == 2 and not any(report.checks.values())


def test_counterfact_stream_is_disjoint_from_the_bundled_corpus(data_dir, tmp_path):
    from aloe_eval.streams import main

    path = main(["counterfact", "--data", str(data_dir / "counterfact"), "--out", str(tmp_path / "stream.jsonl")])
    stream = load_edits(path)
    import gzip

    raw = gzip.decompress(default_corpus_path().read_bytes()).decode()
    corpus = [json.loads(line) for line in raw.splitlines() if line.strip()]
    # checked here on the raw corpus file, not through the module under test
    assert not {r.id for r in stream} & {c["id"] for c in corpus}
    assert not {(r.subject, r.prompt) for r in stream} & {(c["subject"], c["prompt"]) for c in corpus}
    assert len({r.prompt for r in stream}) == len(stream) > 7500
    val = json.loads((data_dir / "counterfact" / "counterfact-val.json").read_text())
    assert stream[0].id == str(val[0]["case_id"])  # CounterFact val comes first
    report = json.loads((tmp_path / "stream.jsonl.report.json").read_text())
    assert report["kept"] == len(stream)


def test_in_context_stream_puts_each_request_after_unrelated_text(tmp_path):
    from aloe_build.data import save_edits_jsonl
    from aloe_eval.in_context import in_context
    from aloe_eval.streams import IN_CONTEXT_PER_EDIT, main

    records = [
        EditRequest(
            prompt=f"{s} is in",
            target_new="Peru",
            subject=s,
            rephrases=(f"{s} lies in",),
            locality=(f"Oslo{i} is in",),
            portability=({"prompt": "Where?", "ground_truth": "Peru"},),
            id=str(i),
        )
        for i, s in enumerate(["Paris", "Rome", "Lima"])
    ]
    src = save_edits_jsonl(records, tmp_path / "in.jsonl")
    out = load_edits(main(["in-context", str(src), "--limit", "2", "--out", str(tmp_path / "out.jsonl")]))
    assert [e.id for e in out] == ["0", "1"]
    for i, (e, r) in enumerate(zip(out, records)):
        assert e.rephrases == in_context(r.prompt, IN_CONTEXT_PER_EDIT, IN_CONTEXT_PER_EDIT * i)
        assert all(q.endswith(r.prompt) and q != r.prompt for q in e.rephrases)
        assert [lp.prompt for lp in e.locality] == [f"Oslo{i} is in"] and e.portability == ()
