"""Figures of the summary computed from the per-edit rows."""

from __future__ import annotations

import pytest


def test_locality_outside_stream_leaves_out_prompts_the_stream_edits():
    """A locality prompt that is another edit's request is left out of the figure, counted, and
    the rest averaged per edit, then over edits with a prompt left."""
    from aloe_eval.summary import locality_outside_stream

    def row(prompt, *loc):
        return {"prompt": prompt, "locality_prompts": [{"prompt": q, "stable": s} for q, s in loc]}

    rows = [
        row("A is", ("B is", 0.0), ("C1 is", 1.0)),  # "B is" is edit 2's request
        row("B is", ("D1 is", 1.0), ("D2 is", 0.0)),
        row("C is", ("A is", 0.0)),
    ]  # its only prompt is edit 1's request
    got, left_out = locality_outside_stream(rows)
    assert left_out == 2
    assert got == pytest.approx((1.0 + 0.5) / 2)
    assert locality_outside_stream([row("A is", ("B is", 1.0))]) == (1.0, 0)
    # an operator's edits beyond the rows scored: "B is" is one of them
    assert locality_outside_stream([row("A is", ("B is", 0.0), ("E is", 1.0))], {"A is", "B is"}) == (1.0, 1)
