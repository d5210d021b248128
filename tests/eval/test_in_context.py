"""The held-out sentences that put a request in context for evaluation."""

from __future__ import annotations


def test_in_context_prefixes_are_held_out_from_the_construction_corpus() -> None:
    """The sentences that put a request in context for evaluation never occur in the bundled
    corpus, whose statements the build puts before requests; k prompts cycle through them."""
    import gzip

    from aloe_build.corpus import BUNDLED_CORPUS
    from aloe_eval.in_context import PREFIXES, in_context

    corpus_text = gzip.decompress(BUNDLED_CORPUS.read_bytes()).decode()
    assert all(p not in corpus_text for p in PREFIXES)
    got = in_context("The capital of France is", 3, len(PREFIXES) - 1)
    assert got == (
        f"{PREFIXES[-1]} The capital of France is",
        f"{PREFIXES[0]} The capital of France is",
        f"{PREFIXES[1]} The capital of France is",
    )
