"""Requests in context: the request after unrelated text, as a deployed model sees it.

A system prompt, a conversation or a document usually comes before a question. These
sentences were written for checking that an edit still fires there; none comes from the
construction corpus (whose statements the build puts before requests, see
``BuildConfig.positives_prefixed``), so they measure what the build was not shown.
"""

from __future__ import annotations

#: In-context forms of each request that an evaluation scores (and ``streams in-context`` writes),
#: the prefixes taken in turn over the stream: edit i gets prefixes 2i and 2i + 1, one each.
IN_CONTEXT_PER_EDIT = 2

# Plain text of the kinds that precede a question in use: an instruction, small talk, a
# sentence of some unrelated document.
PREFIXES = (
    "Please answer the following question.",
    "I was reading about this yesterday.",
    "The weather was cold that winter.",
    "Here is a short quiz on general knowledge.",
    "He said nothing more about it.",
    "This page lists some facts.",
    "My friend asked me something interesting.",
    "The meeting ended early on Friday.",
)


def in_context(prompt: str, k: int, start: int = 0) -> tuple[str, ...]:
    """``prompt`` after ``k`` of :data:`PREFIXES`, beginning at index ``start`` (cyclically)."""
    return tuple(f"{PREFIXES[(start + j) % len(PREFIXES)]} {prompt}" for j in range(k))


def request_in_context(prompt: str, index: int) -> tuple[str, ...]:
    """The in-context forms of the request of edit ``index`` (its position in the stream)."""
    return in_context(prompt, IN_CONTEXT_PER_EDIT, IN_CONTEXT_PER_EDIT * index)
