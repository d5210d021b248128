"""``python -m aloe_eval.streams rephrase-locality``: the rewordings of later, unedited records as locality prompts."""

from __future__ import annotations

import pytest

from aloe_build.data import EditRequest, load_edits, save_edits_jsonl


def _r(i: int, subject: str, rephrases: tuple[str, ...]) -> EditRequest:
    return EditRequest(
        prompt=f"{subject} is in",
        target_new="Peru",
        subject=subject,
        ground_truth=f"gt{i}",
        rephrases=rephrases,
        locality=(f"Oslo{i} is in",),
        id=str(i),
    )


def test_later_rewordings_become_locality_prompts_except_edited_subjects(tmp_path):
    from aloe_eval.streams import REPHRASE_LOCALITY_KIND as KIND
    from aloe_eval.streams import main

    records = [
        _r(0, "Paris", ("Paris r0",)),
        _r(1, "Rome", ("Rome r1",)),
        _r(2, "Lima", ("Lima a", "Lima b", "Lima c")),  # three rewordings: spread over both edits
        _r(3, "Paris", ("Paris again",)),  # an edited subject: skipped
        _r(4, "Bern", ()),
    ]  # no rewording: nothing to add
    src = save_edits_jsonl(records, tmp_path / "in.jsonl")
    out = load_edits(main(["rephrase-locality", str(src), "--limit", "2", "--out", str(tmp_path / "out.jsonl")]))
    assert [e.id for e in out] == ["0", "1"]
    assert [e.rephrases for e in out] == [("Paris r0",), ("Rome r1",)]  # the edits' own rewordings are kept
    assert [[lp.prompt for lp in e.locality] for e in out] == [["Lima a", "Lima c"], ["Lima b"]]
    assert all(lp.kind == KIND and lp.ground_truth == ("gt2",) for e in out for lp in e.locality)


def test_no_later_rewording_is_an_error(tmp_path):
    from aloe_eval.streams import main

    src = save_edits_jsonl([_r(0, "Paris", ("r",)), _r(1, "Paris", ("r2",))], tmp_path / "in.jsonl")
    with pytest.raises(SystemExit, match="no rephrases of unedited subjects"):
        main(["rephrase-locality", str(src), "--limit", "1", "--out", str(tmp_path / "out.jsonl")])
