"""Rewordings of each request written by the model being edited: positives for an address that must
open wherever its fact is asked, made from the request alone.

The model completes a few-shot prompt ("Original: ... / Reworded: ...", examples about invented
subjects) once per shot set, greedily, so that each request gets up to one candidate per set and the
same request always gets the same candidates. A small model often answers, repeats or asks another
question instead, so a candidate is kept only when it names the subject, differs from the request,
keeps its form (a question stays a question, a statement stays unfinished) and shares at least one
word of the request's relation (the words that are neither the subject's nor function words).
"""

from __future__ import annotations

import json
import re
from typing import Sequence

from torch import nn

from .checkpoints import StageCheckpoints, write_atomically
from .config import BuildConfig
from .forward import greedy_generate, progress_bar
from .prefix_generate import generate_after_prefix
from .tokens import encode_prompt, pad_id

#: tokens a candidate may take (a rewording is one line)
CANDIDATE_TOKENS = 24

_QUESTION_SHOTS = (
    (
        ("Who wrote the novel The Silent Harbor?", "Who is the author of The Silent Harbor?"),
        ("In which country is the town of Belmora located?", "Belmora is a town in which country?"),
        ("What sport does Tom Alvarez play?", "Which sport is Tom Alvarez known for playing?"),
    ),
    (
        ("When was the Kestrel Bridge opened?", "In what year did the Kestrel Bridge open?"),
        ("What language did Mira Okonji speak?", "Which language was spoken by Mira Okonji?"),
        ("Who founded Arlo Records?", "Arlo Records was founded by whom?"),
    ),
    (
        ("Which company makes the Vexa Z3?", "The Vexa Z3 is made by which company?"),
        ("What is the capital of Dorland?", "Dorland's capital is which city?"),
        ("Where did Paul Hensley die?", "In which place did Paul Hensley die?"),
    ),
    (
        ("What instrument does Lena Fjord play?", "Lena Fjord plays which instrument?"),
        ("Who is the father of Oren Hale?", "Oren Hale's father is who?"),
        ("What river flows through Castmoor?", "Which river runs through Castmoor?"),
    ),
    (
        ("What team did Ivo Marek play for?", "For which team did Ivo Marek play?"),
        ("What genre is the album Night Glass?", "Night Glass is an album of which genre?"),
        ("Who directed the film Red Orchard?", "Red Orchard was directed by whom?"),
    ),
    (
        ("What was Anna Belov's occupation?", "What did Anna Belov do for a living?"),
        ("Which university did Sam Quill attend?", "Where did Sam Quill go to university?"),
        ("What is the official language of Tarvia?", "Which language is official in Tarvia?"),
    ),
)

_STATEMENT_SHOTS = (
    (
        ("The mother tongue of Lena Fjord is", "Lena Fjord's native language is"),
        ("The Vexa Z3 is produced by", "The maker of the Vexa Z3 is"),
        ("Belmora is located in the country of", "Belmora is a town in"),
    ),
    (
        ("Tom Alvarez plays the sport of", "The sport Tom Alvarez is known for is"),
        ("The capital of Dorland is", "Dorland's capital city is"),
        ("Arlo Records was founded by", "The founder of Arlo Records is"),
    ),
    (
        ("Paul Hensley died in the city of", "The city where Paul Hensley died is"),
        ("Ivo Marek plays for", "The team Ivo Marek plays for is"),
        ("The Silent Harbor was written by", "The author of The Silent Harbor is"),
    ),
    (
        ("Oren Hale's father is", "The father of Oren Hale is"),
        ("Night Glass is an album of the genre", "The genre of the album Night Glass is"),
        ("Mira Okonji works as a", "Mira Okonji's profession is"),
    ),
)

_FUNCTION_WORDS = frozenset(
    """a an the of in on at to for by with from is are was were be been being do does did has have had
    which what who whom whose where when why how that this these those it its as and or not into about
    s name named called""".split()
)


def _shot_prefix(shots: Sequence[tuple[str, str]]) -> str:
    lines = [f"Original: {a}\nReworded: {b}\n" for a, b in shots]
    return "\n".join(lines) + "\nOriginal:"


def _shot_prompt(shots: Sequence[tuple[str, str]], request: str) -> str:
    return _shot_prefix(shots) + f" {request}\nReworded:"


def _words(text: str) -> set[str]:
    return set(re.findall(r"[a-z0-9]+", text.lower()))


def relation_words(request: str, subject: str) -> set[str]:
    """The words of ``request`` that are neither the subject's nor function words."""
    return _words(request) - _words(subject) - _FUNCTION_WORDS


def is_question(text: str) -> bool:
    return text.rstrip().endswith("?")


def keeps(candidate: str, request: str, subject: str) -> bool:
    """Whether ``candidate`` passes as a rewording of ``request`` (module doc)."""
    c = candidate.strip()
    if not c or subject.lower() not in c.lower():
        return False
    if " ".join(c.lower().split()) == " ".join(request.lower().split()):
        return False
    if is_question(c) != is_question(request) or (not is_question(request) and c.endswith(".")):
        return False
    words = relation_words(request, subject)
    return not words or bool(words & _words(c))


def generated_rewordings(
    model: nn.Module, tokenizer, requests: Sequence[tuple[str, str]], k: int, batch_size: int = 32
) -> list[list[str]]:
    """Up to ``k`` kept rewordings of each ``(request, subject)``, written greedily by ``model``
    after each shot set of the request's form (module doc); ``k`` = 0 gives none."""
    if k <= 0:
        return [[] for _ in requests]
    # each shot set's examples run once (generate_after_prefix); a prompt whose tokens do not start
    # with its shot set's (a merge across the boundary) runs whole
    prefix_ids = {shots: encode_prompt(tokenizer, _shot_prefix(shots)) for shots in _QUESTION_SHOTS + _STATEMENT_SHOTS}
    jobs: list[tuple[int, list[int]]] = []
    groups: dict[tuple[tuple[str, str], ...], list[int]] = {}  # shot set -> the jobs that continue its prefix
    for i, (request, _) in enumerate(requests):
        for shots in _QUESTION_SHOTS if is_question(request) else _STATEMENT_SHOTS:
            ids, pre = encode_prompt(tokenizer, _shot_prompt(shots, request)), prefix_ids[shots]
            if len(ids) > len(pre) and ids[: len(pre)] == pre:
                groups.setdefault(shots, []).append(len(jobs))
            jobs.append((i, ids))
    outs: list[list[int]] = [[] for _ in jobs]
    bar = progress_bar(len(jobs), "stage 3: rewordings", True)
    try:
        for shots, members in groups.items():
            pre = prefix_ids[shots]
            got = generate_after_prefix(
                model,
                pre,
                [jobs[j][1][len(pre) :] for j in members],
                CANDIDATE_TOKENS,
                pad_id=pad_id(tokenizer),
                finished=lambda toks: "\n" in tokenizer.decode(toks, skip_special_tokens=True),
                batch_size=batch_size,
            )
            for j, o in zip(members, got):
                outs[j] = o
            bar.update(len(members))
        grouped = {j for members in groups.values() for j in members}
        whole = [j for j in range(len(jobs)) if j not in grouped]
        got = greedy_generate(
            model, [jobs[j][1] for j in whole], CANDIDATE_TOKENS, pad_id=pad_id(tokenizer), batch_size=batch_size
        )
        for j, o in zip(whole, got):
            outs[j] = o
        bar.update(len(whole))
    finally:
        bar.close()
    kept: list[list[str]] = [[] for _ in requests]
    for (i, _), out in zip(jobs, outs):
        text = tokenizer.decode(out, skip_special_tokens=True).split("\n")[0].strip()
        request, subject = requests[i]
        if len(kept[i]) < k and text not in kept[i] and keeps(text, request, subject):
            kept[i].append(text)
    return kept


def kept_rewordings(
    model: nn.Module, tokenizer, requests: Sequence[tuple[str, str]], cfg: BuildConfig, ckpt: StageCheckpoints
) -> list[list[str]]:
    """:func:`generated_rewordings` of ``cfg.experimental.positives_generated`` per request, kept in the
    build's checkpoint folder (``ckpt``) under its stage-3 key,
    so that a resumed build does not write them again."""
    k, key = cfg.experimental.positives_generated, ckpt.key("3_rollouts")
    file = ckpt.root / "rewordings.json" if ckpt.root is not None and k > 0 else None
    if file is not None and file.is_file():
        saved = json.loads(file.read_text())
        if saved.get("key") == key:
            return saved["rewordings"]
    got = generated_rewordings(model, tokenizer, requests, k, cfg.batch_size)
    if file is not None:
        write_atomically(file, lambda tmp: tmp.write_text(json.dumps({"key": key, "rewordings": got})))
    return got
