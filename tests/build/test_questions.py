"""Generic questions: how many, in which forms, about which subjects."""

from __future__ import annotations

from aloe_build.questions import QUESTION_FRAMES, generic_questions

SUBJECTS = [f"Subject {k}" for k in range(50)]


def test_questions_alternate_between_a_question_and_a_search_query():
    qs = generic_questions(SUBJECTS, 10)
    assert len(qs) == 10 == len(set(qs))
    for k, q in enumerate(qs):
        frame = QUESTION_FRAMES[k % len(QUESTION_FRAMES)]
        if k % 2 == 0:
            assert q.endswith("?") and any(frame.format(s) == q for s in SUBJECTS)
        else:
            assert not q.endswith("?") and q == q.lower() and any(frame.format(s)[:-1].lower() == q for s in SUBJECTS)


def test_questions_spread_over_the_subjects_and_are_deterministic():
    qs = generic_questions(SUBJECTS, 10)
    assert qs == generic_questions(SUBJECTS, 10)
    # every fifth subject: the first and the last asked lie at both ends of the list
    assert qs[0] == QUESTION_FRAMES[0].format("Subject 0") and "subject 45" in qs[9]


def test_no_questions_without_subjects_or_count_and_no_repeats_past_the_pairs():
    assert generic_questions([], 5) == [] and generic_questions(SUBJECTS, 0) == []
    qs = generic_questions(["A", "B"], 1000)
    assert len(qs) == len(set(qs)) <= 2 * len(QUESTION_FRAMES)
