"""The in-context control (``--baseline told``): the unedited model asked every prompt of an edit after the
edit's statement, its locality compared with the unedited answers to the plain prompts."""

from __future__ import annotations

import json

import pytest
from eval_helpers import LAYER, tiny_requests
from tiny_models import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer

import aloe_eval.chat as chat
from aloe_build.data import save_edits_jsonl
from aloe_build.forward import greedy_generate
from aloe_build.tokens import encode_continuation, encode_prompt, pad_id, stop_ids, until_end
from aloe_cli import main
from aloe_eval import ToldEditor, UneditedEditor, evaluate
from aloe_eval.chunks import ChunkStore
from aloe_eval.plan import plan
from aloe_eval.scoring import build_reference, told_inputs

TOLD = "unedited, told the fact"
EIFFEL = "The Eiffel Tower is located in the city of"  # edit e0's request; its statement ends in " Rome."


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


@pytest.fixture(scope="module")
def plain_and_told(tiny):
    """The plain plan of the tiny requests with its unedited reference, and the told control's."""
    model, tok = tiny
    reg, plans = plan(tok, tiny_requests())
    ref = build_reference(model, reg, plans, pad_id=pad_id(tok), stops=stop_ids(tok), batch_size=4, progress=False, timings={})
    return (reg, plans, ref), told_inputs(tok, reg, plans, ref)


def test_the_told_plan_asks_every_prompt_after_the_edits_statement(tiny, plain_and_told):
    _, tok = tiny
    _, (reg, plans, _) = plain_and_told
    e0, e1 = plans[0], plans[1]
    assert reg.seqs[e0.seq] == encode_continuation(tok, f"{EIFFEL} Rome. {EIFFEL}", "Rome")
    assert [r.prompt for r in e0.rephrases] == [
        f"{EIFFEL} Rome. The capital of France is",
        f"{EIFFEL} Rome. the capital of Italy is",
    ]
    # the unrelated sentences of edit 0 (the first two), between the statement and the request
    assert [r.prompt for r in e0.in_context] == [
        f"{EIFFEL} Rome. Please answer the following question. {EIFFEL}",
        f"{EIFFEL} Rome. I was reading about this yesterday. {EIFFEL}",
    ]
    assert [lp.prompt for lp in e0.locality] == [f"{EIFFEL} Rome. Toko Yasuda plays the"]
    assert [pp.prompt for pp in e0.portability] == [f"{EIFFEL} Rome. What is the product made by UniFirst ?"]
    assert reg.seqs[e0.portability[0].seq] == encode_continuation(
        tok, f"{EIFFEL} Rome. What is the product made by UniFirst ?", "uniform"
    )
    for asked in e0.rephrases + e0.in_context:  # each asks its text and continues with the target
        assert reg.seqs[asked.seq] == encode_continuation(tok, asked.prompt, "Rome")
    assert reg.seqs[e1.seq] == encode_continuation(tok, "John Lennon plays the guitar. John Lennon plays the", "guitar")
    # edit 1 takes the next two unrelated sentences
    assert [r.prompt for r in e1.in_context] == [
        "John Lennon plays the guitar. The weather was cold that winter. John Lennon plays the",
        "John Lennon plays the guitar. Here is a short quiz on general knowledge. John Lennon plays the",
    ]
    assert [lp.prompt for lp in e1.locality] == [
        "John Lennon plays the guitar. the capital of Italy is",
        "John Lennon plays the guitar. What is the product made by UniFirst ?",
    ]
    # every locality prompt already follows the statement: no distracted prompts of its own
    assert all(p.distracted == [] for p in plans)


def test_told_locality_references_are_the_plain_prompts_unedited_answers(tiny, plain_and_told):
    model, tok = tiny
    (plain_reg, plain_plans, plain_ref), (reg, plans, ref) = plain_and_told
    told_lp, plain_lp = plans[0].locality[0], plain_plans[0].locality[0]
    # the unedited model's answer to the plain neighbour prompt ("guitar" is one token: k = 1), generated here
    answer = until_end(
        greedy_generate(model, [encode_prompt(tok, "Toko Yasuda plays the")], [1], pad_id=pad_id(tok))[0], stop_ids(tok)
    )
    told_ids = tuple(encode_prompt(tok, f"{EIFFEL} Rome. Toko Yasuda plays the"))
    assert reg.seqs[told_lp.gen_seq] == (told_ids, tuple(answer))
    assert reg.seqs[told_lp.tf_seq] == (told_ids, encode_continuation(tok, "Toko Yasuda plays the", "guitar")[1])
    # what the told answers are compared with: the unedited passes over the plain prompts, not the told ones
    assert ref.cache[told_lp.gen_seq] is plain_ref.cache[plain_lp.gen_seq]
    assert ref.cache[told_lp.tf_seq] is plain_ref.cache[plain_lp.tf_seq]
    assert plain_reg.seqs[plain_lp.gen_seq][0] == tuple(encode_prompt(tok, "Toko Yasuda plays the"))
    assert ref.cache[told_lp.gen_seq].preds == tuple(answer)


def test_told_row_locality_is_the_told_answer_against_the_plain_one(tiny):
    model, tok = tiny
    rep = evaluate(model, tok, tiny_requests(), None, baseline=["unedited", "told"], progress=False, layer=LAYER, batch_size=4)
    assert list(rep.editors) == ["unedited", TOLD]
    told = rep.editors[TOLD]
    # (plain locality prompt, its edit's statement, k: tokens of its ground truth, 8 without one)
    cases = [
        ("Toko Yasuda plays the", f"{EIFFEL} Rome.", 1),
        ("the capital of Italy is", "John Lennon plays the guitar.", 8),
        ("What is the product made by UniFirst ?", "John Lennon plays the guitar.", 1),
        ("The Eiffel Tower is located in the", "The capital of France is Rome Paris.", 3),
    ]
    rows = [lr for r in told.rows for lr in r["locality_prompts"]]
    assert [lr["prompt"] for lr in rows] == [f"{s} {q}" for q, s, _ in cases]
    stops, pad = stop_ids(tok), pad_id(tok)
    expected = []
    for (question, said, k), lr in zip(cases, rows):
        plain = until_end(greedy_generate(model, [encode_prompt(tok, question)], [k], pad_id=pad)[0], stops)
        told_answer = greedy_generate(model, [encode_prompt(tok, f"{said} {question}")], [k], pad_id=pad)[0]
        assert lr["reference"] == tok.decode(plain, skip_special_tokens=True)
        expected.append(float(told_answer[: len(plain)] == plain))
    assert [lr["stable"] for lr in rows] == expected
    assert 0.0 in expected  # telling the fact changes some answers on this model: the row is not 1 by construction
    p = told.summary["paper"]
    assert p["distracted_locality"] is None and p["distracted_leak"] is None
    # the unedited row is what it is without the control beside it
    alone = evaluate(model, tok, tiny_requests(), None, baseline="unedited", progress=False, layer=LAYER, batch_size=4)
    assert rep.editors["unedited"].summary["paper"] == alone.summary["paper"]


def test_told_chat_asks_the_statement_first_and_keeps_its_answers_apart(tmp_path, monkeypatch):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    reqs = tiny_requests()[:2]
    asked: dict[str, list] = {}
    real = chat.chat_answers

    def recording(*a, **k):
        asked[k["desc"]] = sorted(a[2])  # the questions of each list (saved lists ask them shortest first)
        return real(*a, **k)

    monkeypatch.setattr(chat, "chat_answers", recording)
    cache, parts = ChunkStore(tmp_path / "cache"), ChunkStore(tmp_path / "parts")
    context = {"editor": TOLD, "state": ToldEditor().state_key()}
    out = chat.chat_evaluation(
        model,
        tok,
        reqs,
        ToldEditor(LAYER),
        batch_size=2,
        progress=False,
        systems={"default_system": None},
        parts=parts,
        context=context,
        model_context="m",
        unedited_parts=cache,
    )["default_system"]
    desc = "chat (default_system): "
    assert asked[desc + "unedited requests"] == ["John Lennon plays the", EIFFEL]
    assert asked[desc + "edited requests"] == ["John Lennon plays the guitar. John Lennon plays the", f"{EIFFEL} Rome. {EIFFEL}"]
    assert asked[desc + "edited locality"] == [
        "John Lennon plays the guitar. What is the product made by UniFirst ?",
        "John Lennon plays the guitar. the capital of Italy is",
        f"{EIFFEL} Rome. Toko Yasuda plays the",
    ]
    assert asked[desc + "unedited locality"] == [
        "Toko Yasuda plays the",
        "What is the product made by UniFirst ?",
        "the capital of Italy is",
    ]
    assert asked[desc + "edited in-context requests"] == [
        "John Lennon plays the guitar. The weather was cold that winter. John Lennon plays the",
        f"{EIFFEL} Rome. Please answer the following question. {EIFFEL}",
    ]
    assert not [d for d in asked if "distracted" in d]
    assert out["distracted_locality"] is None and out["distracted_leak"] is None
    # the shared cache holds the three unedited lists only; the told answers are the editor's own
    assert len(list(cache.root.glob("chat-unedited-*.json.gz"))) == 3
    assert len(list(parts.root.glob("chat-*.json.gz"))) == 3
    assert ToldEditor().state_key() != UneditedEditor().state_key()


def test_cli_eval_baseline_told_writes_the_row_and_its_chat_file(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("ALOE_CACHE", str(tmp_path / "cache"))
    model, _ = tiny
    tok = tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    edits = save_edits_jsonl(tiny_requests(), tmp_path / "edits.jsonl")
    out = tmp_path / "eval"
    args = ["eval", "--model", str(model_dir), "--edits", str(edits), "--out", str(out), "--baseline", "told", "--chat", "also"]
    assert main(args + ["--layer", str(LAYER), "--no-plots", "--quiet", "--batch-size", "4"]) == 0
    told_chat = json.loads((out / "chat_told.json").read_text())
    assert told_chat["meta"]["editor"] == TOLD and told_chat["default_system"]["distracted_locality"] is None
    d = json.loads((out / "eval_report.json").read_text())
    assert list(d["editors"]) == ["unedited", TOLD]
    assert d["editors"][TOLD]["info"]["kind"] == "told"
    assert d["editors"][TOLD]["summary"]["paper"]["distracted_locality"] is None
    assert "--baseline told" in d["meta"]["command"]
    md = (out / "eval_report.md").read_text()
    paper = d["editors"][TOLD]["summary"]["paper"]
    cells = [paper[k] for k in ("efficacy", "generalization", "in_context", "locality", "portability")]
    assert f"| {TOLD} | " + " | ".join(f"{x:.3f}" for x in cells) + " |" in md
    assert f"| {TOLD} | – | – |" in md  # the distracted columns: not applicable
