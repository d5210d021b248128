"""Stage 3's distracting negatives: corpus statements followed by another subject's request."""

from __future__ import annotations

import random

from test_pipeline import _greedy_continued, _rows_contain, _tiny_cfg
from tiny_models import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer

from aloe_build.corpus import load_corpus
from aloe_build.stages import s3_shared_pool
from aloe_build.states import collect_states
from aloe_build.tokens import chat_prompt, encode_prompt


def test_questions_after_statements_are_negatives_past_the_statement(tmp_path):
    """With ``negatives_distracting=k``: for each of the k pairs, every position past the statement
    of '<statement> <question>' and of the unedited continuation is in the pool, and (with chat
    positives) the same for the question as a second user turn; the statement's own positions are not."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    for chat in (False, True):
        cfg = _tiny_cfg(tmp_path, positives_chat=chat, negatives_distracting=3, negative_continuation_tokens=3)
        corpus, _ = load_corpus(cfg.encoder_corpus, cfg.encoder_records, cfg.encoder_same_subject, cfg.seed)
        pool = s3_shared_pool.distracting_negatives(model, tok, 1, tmp_path / "cache", corpus, cfg)
        pairs = corpus.distracting_pairs(3, random.Random(f"{cfg.seed}\x00distracting"))
        assert len(pairs) == 3
        rows = 0
        for said, question in pairs:
            asked = [(encode_prompt(tok, f"{said} {question}"), encode_prompt(tok, said))]
            if chat:
                asked.append((chat_prompt(tok, [said, question]), chat_prompt(tok, said)))
            for ids, head_ids in asked:
                # past the statement: from the first token where the two sequences part
                head = next(t for t, (a, b) in enumerate(zip(ids, head_ids + [-1])) if a != b)
                full = _greedy_continued(model, ids, 3)
                want = collect_states(model, tok, [full], 1, [range(head, len(full))]).states
                assert _rows_contain(pool, want)
                assert not _rows_contain(pool, collect_states(model, tok, [full], 1, [[0]]).states)
                rows += len(full) - head
        assert pool.shape[0] == rows
