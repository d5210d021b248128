"""``aloe eval`` end to end: a saved tiny model and operator, baselines, the report on disk."""

from __future__ import annotations

import hashlib
import json

import pytest
from eval_helpers import LAYER, gate_operator, tiny_requests
from tiny_models import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer

import aloe_cli.eval as cli_eval
import aloe_eval.chat as chat_module
from aloe_build.data import save_edits_jsonl
from aloe_cli import main
from aloe_kernels import AloeOperator
from tests.helpers import stopping_at


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


def _saved(tiny, tmp_path):
    """The tiny model, its edits and an operator that opens on them, on disk."""
    model, tok = tiny
    reqs = tiny_requests()
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    edits = save_edits_jsonl(reqs, tmp_path / "edits.jsonl")
    return model_dir, edits, gate_operator(model, tok, reqs, open_=True).save(tmp_path / "op")


def _give_chat_template(model_dir) -> None:
    """Save the tiny chat template with the saved tokenizer (the tiny tokenizer has none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TINY_CHAT_TEMPLATE
    tok.save_pretrained(model_dir)


def test_cli_end_to_end_with_saved_operator_and_grace(tiny, tmp_path):
    model_dir, edits, op_dir = _saved(tiny, tmp_path)
    out = tmp_path / "eval"
    rc = main(
        [
            "eval",
            "--model",
            str(model_dir),
            "--operator",
            str(op_dir),
            "--edits",
            str(edits),
            "--limit",
            "2",
            "--out",
            str(out),
            "--baseline",
            "grace",
            "--grace-iters",
            "20",
            "--quiet",
            "--batch-size",
            "4",
        ]
    )
    assert rc == 0
    d = json.loads((out / "eval_report.json").read_text())
    assert d["primary"] == "ALOE"
    assert set(d["editors"]) == {"ALOE", "unedited", "GRACE (reimplementation)"}
    meta = d["meta"]
    assert meta["n_edits"] == 2 and meta["operator_hash"] == AloeOperator.load(op_dir).fingerprint()
    assert meta["data_sha256"] == hashlib.sha256(edits.read_bytes()).hexdigest()
    assert meta["command"].startswith("aloe eval --model ") and "--baseline grace" in meta["command"]
    assert (out / "eval_report.md").is_file() and (out / "aloe_gates.png").is_file()
    assert (out / "grace_reimplementation_gates.png").is_file() and (out / "eval_plots.json").is_file()

    # baselines only: no operator
    out2 = tmp_path / "eval2"
    rc = main(
        [
            "eval",
            "--model",
            str(model_dir),
            "--edits",
            str(edits),
            "--out",
            str(out2),
            "--baseline",
            "grace",
            "--grace-iters",
            "5",
            "--no-plots",
            "--quiet",
            "--layer",
            str(LAYER),
        ]
    )
    assert rc == 0
    d = json.loads((out2 / "eval_report.json").read_text())
    assert d["primary"] == "unedited" and "GRACE (reimplementation)" in d["editors"]
    assert d["meta"]["layer"] == LAYER and "operator_hash" not in d["meta"]
    # nothing to evaluate


def test_cli_eval_in_bfloat16_with_the_operator_as_a_gpu_serves_it(tiny, tmp_path):
    model_dir, edits, op_dir = _saved(tiny, tmp_path)
    out = tmp_path / "eval"
    rc = main(
        [
            "eval",
            "--model",
            str(model_dir),
            "--operator",
            str(op_dir),
            "--edits",
            str(edits),
            "--limit",
            "2",
            "--out",
            str(out),
            "--no-unedited",
            "--no-plots",
            "--quiet",
            "--batch-size",
            "4",
            "--device",
            "cpu",
            "--dtype",
            "bfloat16",
            "--operator-dtype",
            "bfloat16",
        ]
    )
    assert rc == 0
    d = json.loads((out / "eval_report.json").read_text())
    assert d["meta"]["settings"]["dtype"] == "bfloat16" and d["meta"]["settings"]["device"] == "cpu"
    assert d["editors"]["ALOE"]["info"]["operator_dtype"] == "bfloat16"


def test_cli_build_refuses_a_missing_device_with_a_message(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the message given on a machine without CUDA")
    edits = save_edits_jsonl(tiny_requests(), tmp_path / "edits.jsonl")
    rc = main(["build", "--model", str(tmp_path), "--edits", str(edits), "--out", str(tmp_path / "op"), "--device", "cuda"])
    assert rc == 2 and "sees no CUDA device" in capsys.readouterr().err


def test_cli_eval_asks_after_extra_system_prompts_only_with_chat(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ALOE_CACHE", str(tmp_path / "cache"))
    model_dir, edits, op_dir = _saved(tiny, tmp_path)
    _give_chat_template(model_dir)
    base = [
        "eval",
        "--model",
        str(model_dir),
        "--operator",
        str(op_dir),
        "--edits",
        str(edits),
        "--limit",
        "2",
        "--no-unedited",
        "--no-plots",
        "--quiet",
        "--batch-size",
        "4",
        "--chat-system",
        "answer in one word",
    ]
    assert main(base + ["--out", str(tmp_path / "none")]) == 2
    assert "--chat-system needs --chat" in capsys.readouterr().err
    out = tmp_path / "chat"
    assert main(base + ["--chat", "only", "--out", str(out)]) == 0
    d = json.loads((out / "chat.json").read_text())
    assert d["system_1"]["system"] == "answer in one word" and d["custom_system"]["system"] is not None
    assert d["default_system"]["system"] is None and d["system_1"]["locality_prompts"] == d["default_system"]["locality_prompts"]
    assert not (out / "eval_report.json").exists()
    first_table = (out / "chat.md").read_text().split("\n\n")[1]
    rows = [line.split(" | ")[0] for line in first_table.splitlines()[2:]]
    assert rows == ["| default_system", "| custom_system", "| system_1"]
    assert "--chat only --chat-system 'answer in one word'" in d["meta"]["command"]
    # the unedited answers (requests, locality, distracted locality and in-context requests, per system
    # prompt) are kept in the cache, and a second evaluation that reads them gives the same figures
    assert len(list((tmp_path / "cache" / "chat-answers").glob("chat-unedited-*.json.gz"))) == 12
    assert main(base + ["--chat", "only", "--out", str(tmp_path / "again")]) == 0
    again = json.loads((tmp_path / "again" / "chat.json").read_text())
    assert {k: v for k, v in again.items() if k != "meta"} == {k: v for k, v in d.items() if k != "meta"}


def test_cli_eval_stopped_in_graces_chat_answers_keeps_the_operators(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("ALOE_CACHE", str(tmp_path / "cache"))
    model_dir, edits, op_dir = _saved(tiny, tmp_path)
    _give_chat_template(model_dir)
    base = ["eval", "--model", str(model_dir), "--operator", str(op_dir), "--edits", str(edits), "--limit", "2"]
    base += ["--baseline", "grace", "--grace-iters", "5", "--chat", "also", "--no-plots", "--quiet", "--batch-size", "4"]
    calls: list = []
    real_chat, real_answers = cli_eval._chat, chat_module.chat_answers
    # each editor's chat evaluation is marked in the record of answer lists generated
    monkeypatch.setattr(cli_eval, "_chat", lambda *a: calls.append(("editor", a[3].name)) or real_chat(*a))
    monkeypatch.setattr(chat_module, "chat_answers", stopping_at(0, real_answers, calls))
    assert main(base + ["--out", str(tmp_path / "whole")]) == 0
    grace = ("editor", "GRACE (reimplementation)")
    assert 1 < calls.index(grace) < len(calls) - 2  # ALOE's lists and GRACE's were generated
    # stopped in GRACE's second answer list, after its first was saved (the unedited ones are cached now)

    def stops_in_graces_second_list(*a, **k):
        calls.append(k["desc"])
        if grace in calls and len(calls) - calls.index(grace) == 3:
            raise KeyboardInterrupt
        return real_answers(*a, **k)

    calls.clear()
    monkeypatch.setattr(chat_module, "chat_answers", stops_in_graces_second_list)
    assert main(base + ["--out", str(tmp_path / "run")]) == 130
    calls.clear()
    monkeypatch.setattr(chat_module, "chat_answers", stopping_at(0, real_answers, calls))
    assert main(base + ["--out", str(tmp_path / "run")]) == 0
    # the rerun generates none of ALOE's answers and only GRACE's unsaved lists
    assert calls[0] == ("editor", "ALOE") and calls[1] == ("editor", "GRACE (reimplementation)")
    for name in ("chat.json", "chat_grace.json"):
        got, want = (json.loads((tmp_path / d / name).read_text()) for d in ("run", "whole"))
        assert {k: v for k, v in got.items() if k != "meta"} == {k: v for k, v in want.items() if k != "meta"}


def test_cli_eval_asks_a_baseline_in_chat_without_an_operator(tiny, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("ALOE_CACHE", str(tmp_path / "cache"))
    model_dir, edits, _ = _saved(tiny, tmp_path)
    _give_chat_template(model_dir)
    base = ["eval", "--model", str(model_dir), "--edits", str(edits), "--limit", "2", "--no-plots", "--quiet"]
    base += ["--layer", str(LAYER), "--grace-iters", "5"]
    assert main(base + ["--chat", "only", "--out", str(tmp_path / "none")]) == 2
    assert "--chat needs --operator or a --baseline" in capsys.readouterr().err
    out = tmp_path / "grace"
    # stopped after the chat answers, while the stream is scored
    monkeypatch.setattr(cli_eval, "evaluate", stopping_at(1, cli_eval.evaluate, []))
    assert main(base + ["--baseline", "grace", "--chat", "also", "--out", str(out)]) == 130
    monkeypatch.undo()
    monkeypatch.setenv("ALOE_CACHE", str(tmp_path / "cache"))
    chat = json.loads((out / "chat_grace.json").read_text())
    assert chat["meta"]["editor"] == "GRACE (reimplementation)"
    assert 0.0 <= chat["default_system"]["efficacy"] <= 1.0 and not (out / "chat.json").exists()
    # the rerun fits GRACE again (reading its saved fit) in another time, and reads every answer back
    monkeypatch.setattr(chat_module, "chat_answers", lambda *a, **k: pytest.fail(f"generated again: {k['desc']}"))
    assert main(base + ["--baseline", "grace", "--chat", "also", "--out", str(out)]) == 0
    again = json.loads((out / "chat_grace.json").read_text())
    assert {k: v for k, v in again.items() if k != "meta"} == {k: v for k, v in chat.items() if k != "meta"}
    report = json.loads((out / "eval_report.json").read_text())
    # the editor asked in chat is the one scored on the stream: fitted once, its fitting time recorded
    grace = report["editors"]["GRACE (reimplementation)"]
    assert grace["info"]["timings"]["fit_s"] > 0
