"""Rewordings the model writes of its requests: which candidates pass, and what the generator returns."""

from __future__ import annotations

from aloe_build.rewordings import generated_rewordings, keeps, relation_words
from tests.tiny_models import tiny_model, tiny_tokenizer

REQUEST, SUBJECT = "What city was Ivan Moffat born in?", "Ivan Moffat"


def test_relation_words_leave_out_the_subject_and_function_words():
    assert relation_words(REQUEST, SUBJECT) == {"city", "born"}
    assert relation_words("The mother tongue of Danielle Darrieux is", "Danielle Darrieux") == {"mother", "tongue"}


def test_a_rewording_that_keeps_the_subject_and_the_relation_passes():
    assert keeps("Ivan Moffat was born in what city?", REQUEST, SUBJECT)
    assert keeps("Which city is ivan moffat born in?", REQUEST, SUBJECT)  # the subject in any case
    assert keeps("Danielle Darrieux's mother tongue is", "The mother tongue of Danielle Darrieux is", "Danielle Darrieux")


def test_answers_repeats_other_questions_and_other_forms_fail():
    assert not keeps("", REQUEST, SUBJECT)
    assert not keeps("Who is the son of Ivan Moffat?", REQUEST, SUBJECT)  # another relation
    assert not keeps("In which city was he born?", REQUEST, SUBJECT)  # no subject
    assert not keeps("what  city was Ivan Moffat born in?", REQUEST, SUBJECT)  # the request again
    assert not keeps("Ivan Moffat was born in the city of Leeds.", REQUEST, SUBJECT)  # an answer
    statement = "The mother tongue of Danielle Darrieux is"
    assert not keeps("Danielle Darrieux's mother tongue is French.", statement, "Danielle Darrieux")
    assert not keeps("What is the mother tongue of Danielle Darrieux?", statement, "Danielle Darrieux")


def test_generator_returns_at_most_k_distinct_kept_rewordings_per_request_and_repeats_itself():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    requests = [(REQUEST, SUBJECT), ("The mother tongue of Danielle Darrieux is", "Danielle Darrieux")]
    got = generated_rewordings(model, tok, requests, 2, batch_size=5)
    assert len(got) == 2
    for (request, subject), texts in zip(requests, got):
        assert len(texts) <= 2 and len(set(texts)) == len(texts)
        assert all(keeps(t, request, subject) for t in texts)
    assert generated_rewordings(model, tok, requests, 2, batch_size=3) == got  # batching changes nothing
    assert generated_rewordings(model, tok, requests, 0) == [[], []]


def test_written_rewordings_are_soft_positives_of_their_slot_along_its_target():
    from aloe_build.config import BuildConfig
    from aloe_build.corpus import load_corpus
    from aloe_build.data import EditRequest
    from aloe_build.slots import make_slots
    from aloe_build.stages.s3_rollouts import token_sequences
    from aloe_build.tokens import encode_prompt

    tok = tiny_tokenizer()
    edits = [
        EditRequest(prompt=REQUEST, target_new="Leeds", subject=SUBJECT),
        EditRequest(prompt="Who made X1?", target_new="Y", subject="X1"),
    ]
    slots, cfg = make_slots(edits), BuildConfig(positives_prefixed=0)
    corpus, _ = load_corpus(None, 50, 0, 0)
    written = [["Ivan Moffat was born in what city?", "Which city is Ivan Moffat born in?"], ["X1 was made by whom?"]]
    seqs = token_sequences(tok, slots, corpus, cfg, written)
    assert seqs.extra_prompts == [encode_prompt(tok, t) for texts in written for t in texts]
    assert seqs.extra_owner == [0, 0, 1] and all(seqs.extra_soft) and all(seqs.extra_along)
    assert seqs.extra_targets == [seqs.targets[0], seqs.targets[0], seqs.targets[1]]
    assert token_sequences(tok, slots, corpus, cfg).extra_prompts == []


def test_rewordings_are_kept_under_the_stage_3_key_and_written_again_for_another(tmp_path, monkeypatch):
    import aloe_build.rewordings as rewordings
    from aloe_build.checkpoints import StageCheckpoints
    from aloe_build.config import BuildConfig

    calls = []

    def fake(model, tokenizer, requests, k, batch_size):
        calls.append(k)
        return [[f"{p} #{len(calls)}"] for p, _ in requests]

    monkeypatch.setattr(rewordings, "generated_rewordings", fake)
    asked = [(REQUEST, SUBJECT)]
    cfg = BuildConfig(positives_generated=2)
    first = rewordings.kept_rewordings(None, None, asked, cfg, StageCheckpoints(tmp_path, "base", cfg))
    again = rewordings.kept_rewordings(None, None, asked, cfg, StageCheckpoints(tmp_path, "base", cfg))
    assert first == again == [[f"{REQUEST} #1"]] and calls == [2]  # read back, not written again
    other = rewordings.kept_rewordings(None, None, asked, cfg, StageCheckpoints(tmp_path, "other requests", cfg))
    assert other == [[f"{REQUEST} #2"]] and calls == [2, 2]
    unkept = rewordings.kept_rewordings(None, None, asked, cfg, StageCheckpoints(None, "base", cfg))
    assert unkept == [[f"{REQUEST} #3"]]


def test_generation_after_a_shared_prefix_matches_whole_prompts_and_stops_when_rows_finish():
    import pytest
    import torch

    from aloe_build.forward import greedy_generate
    from aloe_build.prefix_generate import generate_after_prefix

    model = tiny_model("llama")
    gen = torch.Generator().manual_seed(7)
    prefix = torch.randint(3, 100, (11,), generator=gen).tolist()
    suffixes = [torch.randint(3, 100, (n,), generator=gen).tolist() for n in (1, 5, 3, 7, 2)]
    whole = greedy_generate(model, [prefix + s for s in suffixes], 6, pad_id=0, batch_size=1)  # no padding
    for size in (1, 2, 5):
        assert generate_after_prefix(model, prefix, suffixes, 6, pad_id=0, batch_size=size) == whole
    # a batch stops once every row is finished; each row's tokens are still a prefix of its whole run
    short = generate_after_prefix(model, prefix, suffixes, 6, pad_id=0, batch_size=5, finished=lambda t: len(t) >= 2)
    assert [len(r) for r in short] == [2] * 5 and all(w[:2] == r for w, r in zip(whole, short))
    assert generate_after_prefix(model, prefix, [], 6, pad_id=0) == []
    with pytest.raises(ValueError, match="prefix is empty"):
        generate_after_prefix(model, [], suffixes, 6, pad_id=0)
    with pytest.raises(ValueError, match="at least one token"):
        generate_after_prefix(model, prefix, [[1], []], 6, pad_id=0)
