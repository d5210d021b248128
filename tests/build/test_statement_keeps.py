"""Stage 8's keep sequences: questions after each edit's statement with the model's own answers."""

from __future__ import annotations

import json

import torch
from tiny_models import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer

from aloe_build.config import BuildConfig
from aloe_build.corpus import load_corpus
from aloe_build.data import EditRequest
from aloe_build.slots import make_slots
from aloe_build.statement_keeps import keep_questions, statement_keeps
from aloe_build.tokens import chat_prompt, encode_prompt, stop_ids


def _edits() -> list[EditRequest]:
    return [
        EditRequest(prompt="The Eiffel Tower is located in the city of", target_new="Rome", subject="Eiffel Tower", id="a"),
        EditRequest(prompt="Toko Yasuda plays the", target_new="piano", subject="Toko Yasuda", id="c"),
    ]


def _greedy(model, ids: list[int], n: int, stops: set[int]) -> list[int]:
    """The model's greedy continuation, one full pass per token (no cache), cut before a stop token."""
    out = list(ids)
    for _ in range(n):
        with torch.no_grad():
            nxt = int(model(torch.tensor([out])).logits[0, -1].argmax())
        if nxt in stops:
            break
        out.append(nxt)
    return out[len(ids) :]


def test_keep_questions_are_drawn_per_request_and_avoid_its_subject():
    corpus, _ = load_corpus(None, 300, 0, 0)
    slot = make_slots(_edits())[0]
    first = keep_questions(corpus, slot, 3, seed=0)
    assert len(first) == len(set(first)) == 3
    assert first == keep_questions(corpus, make_slots(_edits()[::-1])[1], 3, seed=0)  # other edits do not matter
    assert first != keep_questions(corpus, slot, 3, seed=1)
    fake = make_slots([EditRequest(prompt=f"{corpus.subjects[0]} is a", target_new="x", subject=corpus.subjects[0])])[0]
    assert not any(corpus.subjects[0] in q for q in keep_questions(corpus, fake, 50, seed=0))


def test_statement_keeps_hold_each_statement_question_and_the_unedited_answer():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    corpus, _ = load_corpus(None, 300, 0, 0)
    slots = make_slots(_edits())
    assert statement_keeps(model, tok, slots, corpus, 1, BuildConfig(positives_chat=True)).seqs == []
    for chat in (False, True):
        cfg = BuildConfig(positives_chat=chat, finetune_keep_after_statement=2, negative_continuation_tokens=5)
        keeps = statement_keeps(model, tok, slots, corpus, 1, cfg)
        expected = []
        for i, s in enumerate(slots):
            said = f"{s.prompt} {s.target}."
            for q in keep_questions(corpus, s, 2, cfg.seed):
                forms = [encode_prompt(tok, f"{said} {q}")] + ([chat_prompt(tok, [said, q])] if chat else [])
                for p in forms:
                    answer = _greedy(model, p, 5, set(stop_ids(tok)))
                    if answer:
                        expected.append((p + answer, len(answer), i))
        assert list(zip(keeps.seqs, keeps.answer_lens, keeps.owners)) == expected
        assert len(expected) > 0


def test_a_build_with_keeps_trains_on_them_and_reports_how_many_it_keeps(tmp_path):
    from test_pipeline import _tiny_cfg

    from aloe_build.pipeline import build_operator

    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = _tiny_cfg(tmp_path, finetune_keep_after_statement=2, positives_prefixed=0)
    build_operator(model, tok, _edits(), cfg, out_dir=tmp_path / "op", log=None)
    stage8 = json.loads((tmp_path / "op" / "build_report.json").read_text())["stages"]["8_finetune"]
    assert 0 < stage8["keep_sequences"] <= 2 * len(_edits())
    assert 0.0 <= stage8["kept"] <= 1.0


def test_negatives_after_statement_are_the_question_positions_of_each_own_negative():
    """Stage 3 with negatives_after_statement=k: per slot, k of its own negative prompts after its
    statement, plainly and (with chat positives) as a second user turn; only positions past the
    statement are negatives, and the statement's text is in each sequence."""
    import random

    from aloe_build.data import fact_statement
    from aloe_build.stages import s3_rollouts as rollouts

    tok = tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    corpus, _ = load_corpus(None, 300, 0, 0)
    slots = make_slots(_edits())
    for chat in (False, True):
        base = BuildConfig(positives_chat=chat, positives_prefixed=0)
        cfg = BuildConfig(positives_chat=chat, positives_prefixed=0, negatives_after_statement=2)
        seqs = rollouts.token_sequences(tok, slots, corpus, base)
        before = rollouts.edit_negative_sequences(tok, slots, seqs, corpus, base, random.Random(0))
        after = rollouts.edit_negative_sequences(tok, slots, seqs, corpus, cfg, random.Random(0))
        for i, s in enumerate(slots):
            own = [(q, p) for q, p, o in zip(*before) if o == i]
            more = [(q, p) for q, p, o in zip(*after) if o == i][len(own) :]
            assert len(more) == 2 * (2 if chat else 1)
            said = fact_statement(s.prompt, s.target)
            plain_head = encode_prompt(tok, said)
            chat_head = tok(f"user : {said} .", add_special_tokens=False)["input_ids"]  # the first user turn
            for k, (q, p) in enumerate(more):
                head = chat_head if chat and k % 2 == 1 else plain_head
                assert q[: len(head)] == head
                # past the statement only (a position whose prefix the slot already has is left out)
                assert set(p) <= set(range(len(head), len(q))) and p[-1] == len(q) - 1
