"""The construction corpus: training items for the address encoder and the
shared pool of negative prompts.

It comes from a benchmark split that is NOT the stream being edited
(default: a bundled part of CounterFact train), so no evaluation field of the edited stream
(rephrases, locality prompts) is ever used to build its operator.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .data import EditRequest, load_edits, relation_templates

# The first 4,000 records of CounterFact's train split (EasyEdit split; MIT
# license, from ROME), shipped with the package so that a build needs no
# external data. Streams evaluated here come from other splits.
BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpora" / "counterfact-train-4k.jsonl.gz"
# Bumped whenever what is mined from a corpus changes (it keys the encoder cache).
# 2: templates grouped into relations through the records' rephrases and locality prompts.
CORPUS_VERSION = 2


def default_corpus_path() -> Path:
    if not BUNDLED_CORPUS.is_file():
        raise FileNotFoundError(
            f"construction corpus not found at {BUNDLED_CORPUS}: reinstall the package or pass "
            "BuildConfig.encoder_corpus (a CounterFact-style file with rephrase and locality prompts)"
        )
    return BUNDLED_CORPUS


def _true_statement(record: EditRequest) -> str:
    """A corpus record's true fact as a sentence ("The mother tongue of Danielle Darrieux is French.")."""
    return f"{record.prompt} {record.ground_truth[0]}."


def _leading_sentences(records: Sequence[EditRequest]) -> list[str]:
    """The text before the sentence that asks, of each rewording that opens with some ("He died in
    Paris aged 67. <subject> ..."): a capital first, at least four words, ending in '.', '?' or '!';
    once each, in corpus order."""
    out: dict[str, None] = {}
    for r in records:
        for text in r.rephrases:
            at = text.find(r.subject) if r.subject else -1
            lead = text[:at].rstrip() if at > 0 else ""
            if lead[:1].isupper() and len(lead.split()) >= 4 and lead.endswith((".", "?", "!")):
                out[lead] = None
    return list(out)


@dataclass
class CorpusItem:
    """One training item: request t, paraphrase x+, locality input x-, same-subject other-relation prompts r-."""

    request: str
    paraphrase: str
    locality: str
    same_subject: list[str]
    group: str  # relation id, or the template when the data has none
    subject: str


class Corpus:
    """Construction corpus items plus the templates mined from it."""

    def __init__(self, records: list[EditRequest], same_subject: int, seed: int):
        self.records = [r for r in records if r.rephrases and r.locality and r.template]
        if len(self.records) < 8:
            raise ValueError(
                f"construction corpus: only {len(self.records)} usable records (each needs a rephrase, a locality "
                "prompt and a subject inside its prompt)"
            )
        self.templates = relation_templates(self.records)
        if len(self.templates) < 2:
            raise ValueError(
                "construction corpus: its templates form a single relation, so there are no other-relation "
                "prompts to serve as same-subject negatives; use a corpus with several relations"
            )
        self.group_of_template = {t: g for g, ts in self.templates.items() for t in ts}
        self.subjects = sorted({r.subject for r in self.records})
        # true statements of the corpus ("The mother tongue of Danielle Darrieux is French."): text
        # that can stand before a request the way a conversation or a document would
        self.statements = [_true_statement(r) for r in self.records if r.ground_truth]
        # the sentences the corpus' rewordings open with ("He died in Paris aged 67."): prose of every
        # kind, not facts of its relations, as a question in running text follows
        self.prose = _leading_sentences(self.records)
        rng = random.Random(seed)
        groups = list(self.templates)
        self.items: list[CorpusItem] = []
        for r in self.records:
            group = self.group_of_template[r.template]
            others = self.other_relation_prompts(r.subject, group, same_subject, rng, groups)
            self.items.append(CorpusItem(r.prompt, r.rephrases[0], r.locality[0].prompt, others, group, r.subject))

    def other_relation_prompts(
        self, subject: str, group: str, k: int, rng: random.Random, groups: list[str] | None = None
    ) -> list[str]:
        """``k`` prompts about ``subject`` under templates of other relation groups."""
        groups = groups or list(self.templates)
        out: list[str] = []
        tries = 0
        while len(out) < k and tries < 20 * k:
            tries += 1
            g = rng.choice(groups)
            if g == group:
                continue
            out.append(rng.choice(self.templates[g]).replace("{}", subject))
        return out

    def same_relation_prompts(self, template: str, subject: str, k: int, rng: random.Random) -> list[str]:
        """Up to ``k`` other templates of ``template``'s relation filled with ``subject``: paraphrases
        of the request built from construction data alone (empty when the template is unknown)."""
        group = self.group_of_template.get(template)
        others = [t for t in self.templates.get(group, []) if t != template] if group is not None else []
        return [t.replace("{}", subject) for t in rng.sample(others, min(k, len(others)))]

    def statement_pool(self, size: int, rng: random.Random) -> list[str]:
        """``size`` corpus statements drawn at random (all of them, in order, when ``size`` is 0 or
        at least their number): the statements a build puts before its requests."""
        if size <= 0 or size >= len(self.statements):
            return list(self.statements)
        return rng.sample(self.statements, size)

    def prefixed_prompts(self, prompt: str, k: int, rng: random.Random, statements: Sequence[str] | None = None) -> list[str]:
        """``prompt`` after ``k`` different statements ("<statement> <prompt>", as many as there are)
        of ``statements`` (default: every corpus statement): the request in context, which must still
        reach the edit."""
        pool = self.statements if statements is None else statements
        picked = rng.sample(list(pool), min(k, len(pool)))
        return [f"{text} {prompt}" for text in picked]

    def distracting_pairs(self, k: int, rng: random.Random) -> list[tuple[str, str]]:
        """Up to ``k`` (statement, question) pairs: the first corpus records' true statements, each
        followed by the request of another record of the same relation about another subject, as a
        conversation asks one fact after mentioning another."""
        by_group: dict[str, list[CorpusItem]] = {}
        for it in self.items:
            by_group.setdefault(it.group, []).append(it)
        pairs: list[tuple[str, str]] = []
        for r, it in zip(self.records, self.items):
            if len(pairs) >= k:
                break
            others = [o for o in by_group[it.group] if o.subject != it.subject]
            if r.ground_truth and others:
                pairs.append((_true_statement(r), rng.choice(others).request))
        return pairs

    def other_subject_prompts(self, template: str, subject: str, k: int, rng: random.Random) -> list[str]:
        """``template`` filled with ``k`` other corpus subjects (same relation, other subject)."""
        out: list[str] = []
        while len(out) < k and len(self.subjects) > 1:
            s = rng.choice(self.subjects)
            if s != subject:
                out.append(template.replace("{}", s))
        return out


# Relation words that a template can swap: lower-case words of four letters or more, less the
# words that only change how a question is put (swapping "what" for "which" is a rewording)
_CONTENT_WORD = re.compile(r"^[a-z]{4,}$")
_FUNCTION_WORDS = frozenset(
    "what which where when whom whose that this these those there their with from into onto upon "
    "does have been being were also about".split()
)


def _is_relation_word(word: str) -> bool:
    return bool(_CONTENT_WORD.match(word)) and word not in _FUNCTION_WORDS


def relation_words(templates: Iterable[str]) -> list[str]:
    """The distinct content words of ``templates`` (never the ``{}`` slot), in first-seen order."""
    seen: dict[str, None] = {}
    for t in templates:
        for w in t.split():
            if _is_relation_word(w):
                seen.setdefault(w, None)
    return list(seen)


def word_swapped_templates(template: str, words: Sequence[str], k: int, rng: random.Random) -> list[str]:
    """Up to ``k`` distinct copies of ``template`` with one content word replaced by another of
    ``words`` ("The date of birth of {} is" -> "The place of birth of {} is"): prompts that share
    all of the request's phrasing but one relation word, so its address must depend on that word."""
    tokens = template.split(" ")
    spots = [i for i, w in enumerate(tokens) if _is_relation_word(w)]
    own = set(tokens)
    pool = [w for w in words if w not in own]
    out: dict[str, None] = {}
    tries = 0
    while spots and pool and len(out) < k and tries < 20 * k:
        tries += 1
        i = rng.choice(spots)
        out.setdefault(" ".join(tokens[:i] + [rng.choice(pool)] + tokens[i + 1 :]), None)
    return list(out)


# Clauses that turn a request ending in its verb into a question about a value other than the
# target: "The occupation of X is" -> "The occupation of X, which is not <target>, is"
EXCLUSION_CLAUSES = (", which is not {},", ", other than {},", ", apart from {},")
_FINAL_VERBS = frozenset({"is", "are", "was", "were"})


def exclusion_prompts(prompt: str, target: str, k: int) -> list[str]:
    """Up to ``k`` rewordings of ``prompt`` that ask for something other than ``target`` (empty
    unless the prompt ends in is/are/was/were): they hold the request's subject, relation and
    even the target's own tokens, yet the edit must not fire on them."""
    head, sep, last = prompt.rpartition(" ")
    if not sep or last not in _FINAL_VERBS or not head:
        return []
    return [f"{head}{clause.format(target)} {last}" for clause in EXCLUSION_CLAUSES[: max(k, 0)]]


def load_corpus(path: str | os.PathLike | None, limit: int, same_subject: int, seed: int) -> tuple[Corpus, Path]:
    """Read the first ``limit`` records of a construction corpus file (default: the bundled one)."""
    p = Path(path) if path else default_corpus_path()
    return Corpus(load_edits(p, limit=limit), same_subject, seed), p
