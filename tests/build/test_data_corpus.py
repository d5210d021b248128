"""Tests of the corpus-side helpers that turn edit requests into construction prompts
(aloe_build.corpus): word-swapped templates, exclusion prompts and prefixed prompts."""

from __future__ import annotations


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
    assert got == [
        "The names of the cast members of Purgatory, which is not Sam Shepard, are",
        "The names of the cast members of Purgatory, other than Sam Shepard, are",
    ]
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


def test_prefixed_prompts_draw_statements_as_a_plain_sample() -> None:
    """The statements before a request are drawn exactly as a plain sample of them would be (the
    draws of earlier builds), as many as the corpus has."""
    import random

    from aloe_build.corpus import load_corpus

    corpus = load_corpus(None, 400, 2, 0)[0]
    assert corpus.prefixed_prompts("x", 4, random.Random(3)) == [f"{t} x" for t in random.Random(3).sample(corpus.statements, 4)]


def test_statement_pool_is_a_sample_of_the_corpus_statements_and_requests_draw_from_it() -> None:
    """A build's statements before its requests: ``size`` distinct corpus statements (all of them,
    in order, for 0 or more than there are); each request gets distinct ones of that pool."""
    import random

    from aloe_build.corpus import load_corpus

    corpus = load_corpus(None, 60, 2, 0)[0]
    pool = corpus.statement_pool(7, random.Random(1))
    assert len(pool) == len(set(pool)) == 7 and set(pool) <= set(corpus.statements)
    assert corpus.statement_pool(0, random.Random(1)) == corpus.statements
    assert corpus.statement_pool(10_000, random.Random(1)) == corpus.statements
    rng = random.Random(2)
    for prompt in ("The capital of France is", "Toko Yasuda plays the"):
        got = corpus.prefixed_prompts(prompt, 3, rng, pool)
        before = [text[: -len(prompt) - 1] for text in got]
        assert all(text.endswith(f" {prompt}") for text in got)
        assert len(set(before)) == 3 and set(before) <= set(pool)
    assert len(corpus.prefixed_prompts("x", 50, rng, pool)) == 7


def test_distracting_pairs_follow_a_true_statement_with_another_subjects_same_relation_request() -> None:
    """Each pair is a corpus record's true statement, in corpus order (a record whose relation has no
    other subject is passed over), then the request of a record of the same relation about another
    subject."""
    import random

    from aloe_build.corpus import load_corpus

    corpus = load_corpus(None, 200, 2, 0)[0]
    pairs = corpus.distracting_pairs(40, random.Random(0))
    assert len(pairs) == 40
    index = {f"{r.prompt} {r.ground_truth[0]}.": k for k, r in enumerate(corpus.records) if r.ground_truth}
    by_request = {r.prompt: r for r in corpus.records}
    order = [index[statement] for statement, _ in pairs]
    assert order == sorted(order) and len(set(order)) == len(order) and order[0] == 0
    for (_, question), k in zip(pairs, order):
        said, asked = corpus.records[k], by_request[question]
        assert asked.subject != said.subject
        assert corpus.group_of_template[asked.template] == corpus.group_of_template[said.template]
    assert corpus.distracting_pairs(0, random.Random(0)) == []


def test_prose_is_the_leading_sentences_of_rewordings_that_open_with_some() -> None:
    """A rewording's text before its subject is prose when it starts with a capital, has four words
    or more and ends a sentence; fragments, short openings and rewordings that start with the subject
    give none; a sentence is kept once."""
    from aloe_build.corpus import _leading_sentences
    from aloe_build.data import EditRequest

    def rec(subject: str, *rephrases: str) -> EditRequest:
        return EditRequest(prompt=f"{subject} plays the", target_new="piano", subject=subject, rephrases=rephrases)

    records = [
        rec("Toko Yasuda", "He died in Paris aged 67. Toko Yasuda is incredible at", "Toko Yasuda plays"),
        rec("Ann Lee", "and Sallie Beavers Riley. Ann Lee plays", "It is found in Palestine. Ann Lee plays"),
        rec("Bo Kim", "Vol. Bo Kim plays", "Why did it rain so hard? Bo Kim plays", "He died in Paris aged 67. Bo Kim"),
        rec("Cy Ode", "The film was released in 1990, Cy Ode plays"),
    ]
    assert _leading_sentences(records) == [
        "He died in Paris aged 67.",
        "It is found in Palestine.",
        "Why did it rain so hard?",
    ]


def test_the_bundled_corpus_gives_prose_none_of_which_is_a_statement() -> None:
    from aloe_build.corpus import load_corpus

    corpus = load_corpus(None, 4000, 2, 0)[0]
    assert len(corpus.prose) > 300
    assert not set(corpus.prose) & set(corpus.statements)
