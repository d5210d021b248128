"""Tests of the edit-request data classes and their validation (aloe_build.data.requests)."""

from __future__ import annotations

import pytest

from aloe_build.data import EditRequest, LocalityPrompt, normalize_answers


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
