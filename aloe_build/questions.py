"""Generic questions about an entity, the kind users put to a served model.

A question-form edit ("What is the product made by UniFirst?") is addressed at the state of its
closing question mark. Every other question ends there too, and a question typed as a search
query ("when did the afl start") gets its question mark from the model, as the first token of
the answer. The construction corpus holds statements, so without these a slot learns nothing
about the question marks of unrelated questions, and a gate widened towards rewordings opens on
them and writes its target into the answer (zsRE locality, docs/results.md, "Generic questions as shared
negatives").

The frames are asked about construction-corpus subjects, never about the stream's, and written
without reference to any benchmark's relations: they are negatives shared by every edit
(``BuildConfig.negatives_questions``).
"""

from __future__ import annotations

from collections.abc import Sequence

#: Bumped whenever the questions change (it names their cached states).
QUESTIONS_VERSION = 1

QUESTION_FRAMES: tuple[str, ...] = (
    "Who is {}?",
    "What is {}?",
    "Where is {}?",
    "Why is {} famous?",
    "What is {} known for?",
    "When did {} begin?",
    "What happened to {}?",
    "Who was involved with {}?",
    "How important is {}?",
    "What is the history of {}?",
    "Where does the name {} come from?",
    "Is {} still around today?",
    "How would you describe {}?",
    "What is special about {}?",
    "Who first wrote about {}?",
    "Which year is {} most associated with?",
    "What do people think of {}?",
    "How many people know about {}?",
    "Can you tell me about {}?",
    "What is a fun fact about {}?",
)


def generic_questions(subjects: Sequence[str], n: int) -> list[str]:
    """``n`` questions (fewer if ``subjects`` run out of distinct pairs): frame ``k`` of
    :data:`QUESTION_FRAMES` in turn about subjects spread over ``subjects``. Every other one is
    written as a search query (lower case, no question mark), so that the model's own question
    mark and answer follow it. Deterministic, as the states are cached by ``n`` alone."""
    if n <= 0 or not subjects:
        return []
    step = max(1, len(subjects) // n)
    out: list[str] = []
    for k in range(min(n, len(subjects) * len(QUESTION_FRAMES))):
        text = QUESTION_FRAMES[k % len(QUESTION_FRAMES)].format(subjects[(k * step) % len(subjects)])
        out.append(text if k % 2 == 0 else text[:-1].lower())
    return list(dict.fromkeys(out))
