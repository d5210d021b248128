"""The whole pipeline on a tiny model: shapes, report, determinism, resume, bad input, stage 3."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import running_mean_by_hand, stopping_at
from tiny_models import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer

from aloe_build.config import BuildConfig
from aloe_build.data import EditRequest, save_edits_jsonl
from aloe_build.pipeline import BuildError, build_operator
from aloe_build.stages.s7_ridge import gates_of
from aloe_kernels import AloeOperator, PatchError, aloe_gates

# ---------------------------------------------------------------- tiny model, whole pipeline

_SUBJECTS = ["Paris", "France", "Italy", "Rome", "Toko", "John", "Lennon", "UniFirst", "Yasuda", "Eiffel"]
_TEMPLATES = ["The capital of {} is", "{} plays the", "What is the product made by {} ?", "{} is located in the city of"]
_WORDS = ["Paris", "Rome", "guitar", "piano", "uniform", "France", "Italy"]


def _tiny_corpus(path, rephrase=lambda i, j, prompt: "the " + prompt):
    """Every subject under every template; ``rephrase(i, j, prompt)`` words the rephrase of record (i, j)."""
    records = []
    for i, s in enumerate(_SUBJECTS):
        for j, t in enumerate(_TEMPLATES):
            records.append(
                EditRequest(
                    prompt=t.replace("{}", s),
                    target_new=_WORDS[(i + j) % len(_WORDS)],
                    subject=s,
                    ground_truth=_WORDS[(i + j + 1) % len(_WORDS)],
                    rephrases=(rephrase(i, j, t.replace("{}", s)),),
                    locality=(_TEMPLATES[j].replace("{}", _SUBJECTS[(i + 3) % 10]),),
                    id=f"c{i}-{j}",
                )
            )
    save_edits_jsonl(records, path)
    return path


def _tiny_cfg(tmp_path, **kw):
    base = dict(
        layer=1,
        encoder_corpus=str(_tiny_corpus(tmp_path / "corpus.jsonl")),
        encoder_records=40,
        encoder_dim=8,
        encoder_steps=20,
        encoder_batch=8,
        encoder_cache=str(tmp_path / "enc"),
        negative_pool_records=10,
        negatives_questions=6,
        negatives_distracting=0,
        refine_steps=30,
        refine_remine_every=10,
        target_steps=5,
        target_batch=4,
        finetune_steps=3,
        finetune_batch=2,
        calibration_steps=10,
        compute_dtype="float32",
    )
    base.update(kw)
    return BuildConfig(**base)


def _edits():
    return [
        EditRequest(prompt="The Eiffel Tower is located in the city of", target_new="Rome", subject="Eiffel Tower", id="a"),
        EditRequest(prompt="The capital of France is", target_new="Rome", subject="France", id="b"),
        EditRequest(prompt="Toko Yasuda plays the", target_new="piano", subject="Toko Yasuda", id="c"),
        EditRequest(prompt="Toko Yasuda plays the", target_new="piano", subject="Toko Yasuda", id="c-dup"),
    ]


def test_tiny_pipeline_shapes_report_and_determinism(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    op = build_operator(model, tok, _edits(), _tiny_cfg(tmp_path), out_dir=tmp_path / "run", log=None)
    assert op.n == 3 and op.d == 48 and op.d_out == 32 and op.layer == 1  # the duplicate shares a slot
    assert op.edits[2]["ids"] == ["c", "c-dup"]
    report = json.loads((tmp_path / "run" / "build_report.json").read_text())
    assert {"1_encoder", "2_init", "3_rollouts", "4_refine", "5_calibrate", "6_targets", "7_ridge", "8_finetune"} <= set(
        report["stages"]
    )
    encoder = report["stages"]["1_encoder"]
    for protocol in ("subject", "relation"):  # each protocol scored, or the reason it could not be
        assert {"learned", "raw_control"} <= set(encoder[protocol]) or "skipped" in encoder[protocol]
    assert 0.0 <= encoder["subject"]["learned"]["scope_auc"] <= 1.0
    targets = report["stages"]["6_targets"]  # the optimiser steps of its batches are reported
    assert 0 <= targets["steps_mean"] <= targets["steps_max"] <= _tiny_cfg(tmp_path).target_max_steps
    assert not list((tmp_path / "run" / "checkpoints").glob("*.parts"))  # stage parts go once a stage is done
    again = build_operator(tiny_model("llama"), tok, _edits(), _tiny_cfg(tmp_path), out_dir=tmp_path / "run2", log=None)
    assert again.fingerprint() == op.fingerprint()


def test_build_report_times_each_stage_and_states_the_operators_gates(tmp_path):
    """Every stage reports wall and CPU seconds and the peak memory so far; the gate statistics
    equal those of the saved operator's gates (reference math) on the stage-3 states."""
    from safetensors.torch import load_file

    from aloe_kernels.reference import open_score_floor

    model, tok = tiny_model("llama"), tiny_tokenizer()
    op = build_operator(model, tok, _edits(), _tiny_cfg(tmp_path), out_dir=tmp_path / "run", log=None)
    report = json.loads((tmp_path / "run" / "build_report.json").read_text())
    for name in ("1_encoder", "2_init", "3_rollouts", "4_refine", "5_calibrate", "6_targets", "7_ridge", "8_finetune", "gates"):
        st = report["stages"][name]
        assert st["seconds"] >= 0 and st["cpu_seconds"] >= 0 and st["peak_rss_gib"] > 0.01, name
    roll = load_file(str(tmp_path / "run" / "checkpoints" / "3_rollouts.safetensors"))
    own = aloe_gates(roll["anchors"].double(), op)[torch.arange(len(roll["anchor_owner"])), roll["anchor_owner"]]
    negatives = aloe_gates(torch.cat([roll["pool"], roll["specific"]]).double(), op)
    gates = report["stages"]["gates"]
    assert gates["anchor_own_gate_median"] == pytest.approx(float(own.median()), abs=1e-5)
    assert gates["anchor_own_gate_min"] == pytest.approx(float(own.min()), abs=1e-5)
    assert gates["anchor_open_share"] == pytest.approx(float((own > 0).double().mean()))
    assert gates["negative_max_gate"] == pytest.approx(float(negatives.max()), abs=1e-5)
    # a gate opens where the score passes the dead zone's edge; rounding decides within 1e-5 of it
    scores = torch.cat([roll["pool"], roll["specific"]]).double() @ op.addresses.double().T
    edge = open_score_floor(op.thresholds.double(), op.temperatures.double(), op.gate_eps)
    clearly, barely = ((scores > edge + d).any(1).double().mean() for d in (1e-5, -1e-5))
    assert clearly <= gates["negative_any_open_share"] <= barely and barely > 0


def test_resume_after_interruption(tmp_path, monkeypatch):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = _tiny_cfg(tmp_path)
    import aloe_build.pipeline as pipeline

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "finetune_writes", boom)
    with pytest.raises(KeyboardInterrupt):
        build_operator(model, tok, _edits(), cfg, out_dir=tmp_path / "run", log=None)
    monkeypatch.undo()
    seen = []
    op = build_operator(model, tok, _edits(), cfg, out_dir=tmp_path / "run", log=seen.append)
    assert sum("resumed from checkpoint" in m for m in seen) == 6  # stages 2-7
    fresh = build_operator(tiny_model("llama"), tok, _edits(), cfg, out_dir=tmp_path / "fresh", log=None)
    assert op.fingerprint() == fresh.fingerprint()
    # the negatives' gate counts of stage 7 come back with its checkpoint
    gates = [json.loads((tmp_path / d / "build_report.json").read_text())["stages"]["gates"] for d in ("run", "fresh")]
    assert {k: v for k, v in gates[0].items() if "seconds" not in k and k != "peak_rss_gib"} == {
        k: v for k, v in gates[1].items() if "seconds" not in k and k != "peak_rss_gib"
    }
    # a later-stage change keeps the earlier checkpoints
    seen.clear()
    build_operator(model, tok, _edits(), _tiny_cfg(tmp_path, finetune_steps=1), out_dir=tmp_path / "run", log=seen.append)
    assert sum("resumed from checkpoint" in m for m in seen) == 6


@pytest.mark.slow
def test_a_stage_resumed_inside_says_so_in_the_report(tmp_path, monkeypatch):
    """Stage 6 stopped after its first batch and resumed: the report counts the batch read back (its
    seconds cover the rest only); a build run through counts none."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = _tiny_cfg(tmp_path, target_batch=1)
    import aloe_build.stages.s6_targets as writes

    monkeypatch.setattr(writes, "_target_batch", stopping_at(2, writes._target_batch, []))
    with pytest.raises(KeyboardInterrupt):
        build_operator(model, tok, _edits(), cfg, out_dir=tmp_path / "run", log=None)
    monkeypatch.undo()
    build_operator(model, tok, _edits(), cfg, out_dir=tmp_path / "run", log=None)
    build_operator(tiny_model("llama"), tok, _edits(), cfg, out_dir=tmp_path / "fresh", log=None)
    stages = [json.loads((tmp_path / d / "build_report.json").read_text())["stages"] for d in ("run", "fresh")]
    assert stages[0]["6_targets"]["parts_read_back"] == 1
    assert all("parts_read_back" not in st for st in stages[1].values())


def test_bad_input(tmp_path, monkeypatch):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = _tiny_cfg(tmp_path)
    with pytest.raises(BuildError, match="no edit requests"):
        build_operator(model, tok, [], cfg, log=None)
    with pytest.raises(PatchError, match="out of range"):
        build_operator(model, tok, _edits(), _tiny_cfg(tmp_path, layer=9), log=None)
    long = EditRequest(prompt=" ".join(["the"] * 80), target_new="Rome", subject="x", id="z")
    with pytest.raises(BuildError, match="over the model context"):
        build_operator(model, tok, [long], cfg, log=None)
    with pytest.raises(PatchError, match="no decoder layer"):
        build_operator(torch.nn.Linear(2, 2), tok, _edits(), cfg, log=None)
    import aloe_build.stages.s4_refine as A

    def nan_refine(V0, *a, **k):
        raise FloatingPointError("stage 4 (address refinement): loss became NaN/Inf")

    monkeypatch.setattr(A, "refine_addresses", nan_refine)
    with pytest.raises(BuildError, match="stage 4.*checkpoints of earlier stages are kept"):
        build_operator(model, tok, _edits(), cfg, out_dir=tmp_path / "nan", log=None)
    assert (tmp_path / "nan" / "checkpoints" / "3_rollouts.safetensors").is_file()


def test_gates_open_on_own_requests_tiny(tmp_path):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    op = build_operator(model, tok, _edits()[:3], _tiny_cfg(tmp_path, refine_steps=200), out_dir=tmp_path / "r", log=None)
    from safetensors.torch import load_file

    from aloe_build.states import last_token_states

    separable = load_file(str(tmp_path / "r" / "checkpoints" / "5_calibrate.safetensors"))["separable"].bool()
    assert separable.any()
    h = last_token_states(model, tok, [e.prompt for e in _edits()[:3]], 1)
    own = aloe_gates(h, op).diagonal()
    # a separable slot opens at >= 0.9 on its request (its worst anchor gets exactly 0.9);
    # an inseparable one sits at a finite-temperature midpoint, still open
    assert (own[separable] >= 0.9 - 1e-4).all() and (own > 0).all()


def test_a_running_reading_build_opens_each_gate_on_its_requests_reading(tmp_path):
    from safetensors.torch import load_file

    from aloe_kernels.hf import locate_down_proj
    from aloe_kernels.reading import reading_of

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    op = build_operator(
        model, tok, edits, _tiny_cfg(tmp_path, refine_steps=200, reading_decay=0.6), out_dir=tmp_path / "r", log=None
    )
    assert op.reading_decay == 0.6 and reading_of(model) is None  # recorded, and the model left as it was
    separable = load_file(str(tmp_path / "r" / "checkpoints" / "5_calibrate.safetensors"))["separable"].bool()
    assert separable.any()
    box = {}
    hook = locate_down_proj(model, 1).module.register_forward_pre_hook(lambda m, a: box.update(h=a[0].detach()))
    last = []
    for e in edits:  # the reading at each request's last token, by hand from an unpadded pass
        with torch.no_grad():
            model(input_ids=torch.tensor([tok(e.prompt)["input_ids"]]))
        last.append(running_mean_by_hand(box["h"], 0.6)[0, -1])
    hook.remove()
    own = aloe_gates(torch.stack(last).float(), op).diagonal()
    assert (own[separable] >= 0.9 - 1e-3).all() and (own > 0).all()


def _rows_contain(rows, states, atol=1e-5):
    """Whether every row of ``states`` occurs in ``rows`` (up to float noise)."""
    return bool(((rows[None, :, :] - states[:, None, :]).abs().amax(-1) < atol).any(1).all())


def _greedy_continued(model, ids: list[int], tokens: int) -> list[int]:
    """``ids`` followed by the tiny model's greedy continuation of ``tokens`` tokens, cut before <eos>."""
    gen = model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=tokens,
        do_sample=False,
        pad_token_id=1,
        eos_token_id=None,
    )[0].tolist()
    return gen[: gen.index(2, len(ids))] if 2 in gen[len(ids) :] else gen


def test_rollouts_take_continuations_and_stream_templates_as_negatives(tmp_path):
    """Stage 3 adds (a) the states of the unedited model's greedy continuation of each request,
    negatives of every slot but their own, (b) the edit's subject under the other requests'
    templates, (c) the edit's template with the other requests' subjects and (d) the edit's template
    with one relation word swapped and (e) the request asking for anything but its target, negatives
    of that edit; none exists when switched off."""
    from safetensors.torch import load_file

    from aloe_build.corpus import load_corpus, relation_words
    from aloe_build.states import collect_states, last_token_states
    from aloe_build.tokens import encode_prompt

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    build_operator(
        model,
        tok,
        edits,
        _tiny_cfg(
            tmp_path,
            negative_continuation_tokens=4,
            negatives_stream_templates=2,
            negatives_stream_subjects=2,
            negatives_word_swaps=4,
            negatives_exclusions=1,
        ),
        out_dir=tmp_path / "on",
        log=None,
    )
    roll = load_file(str(tmp_path / "on" / "checkpoints" / "3_rollouts.safetensors"))
    for i, e in enumerate(edits):
        ids = encode_prompt(tok, e.prompt)
        full = _greedy_continued(model, ids, 4)
        want = collect_states(model, tok, [full], 1, [range(len(ids), len(full))]).states
        got = roll["continuations"][roll["continuation_owner"] == i]
        assert got.shape == want.shape and _rows_contain(got, want)
    # slot 0's subject under slots 1 and 2's templates is a negative of slot 0, and slot 1's under
    # slot 0's template (which no corpus template gives) one of slot 1
    h = last_token_states(model, tok, ["The capital of Eiffel Tower is", "Eiffel Tower plays the"], 1)
    assert _rows_contain(roll["specific"][roll["specific_owner"] == 0], h)
    h = last_token_states(model, tok, ["The France is located in the city of"], 1)
    assert _rows_contain(roll["specific"][roll["specific_owner"] == 1], h)
    # (c): slot 0's template with slot 1's subject is a negative of slot 0 too
    assert _rows_contain(roll["specific"][roll["specific_owner"] == 0], h)

    # (d): slot 0's template with one relation word swapped ("located" or "city" for another word
    # of the stream's or the corpus's templates), filled with its own or another stream subject
    corpus = load_corpus(_tiny_cfg(tmp_path).encoder_corpus, 40, 2, 0)[0]
    words = relation_words([e.template for e in edits] + list(corpus.group_of_template))
    template = edits[0].template
    swapped = [
        template.replace(w, x).replace("{}", subj)
        for w in ("located", "city")
        for x in words
        if x not in template.split()
        for subj in ("Eiffel Tower", "France", "Toko Yasuda")
    ]
    h_swap = last_token_states(model, tok, swapped, 1)

    def swaps_among_negatives(roll) -> int:
        spec = roll["specific"][roll["specific_owner"] == 0]
        return sum(_rows_contain(spec, h_swap[j : j + 1]) for j in range(len(swapped)))

    assert 1 <= swaps_among_negatives(roll) <= 4
    # (e): slot 1's request asking for anything but its target is a negative of slot 1 alone
    h_excl = last_token_states(model, tok, ["The capital of France, which is not Rome, is"], 1)
    assert _rows_contain(roll["specific"][roll["specific_owner"] == 1], h_excl)
    assert not _rows_contain(roll["specific"][roll["specific_owner"] != 1], h_excl)

    build_operator(
        model,
        tok,
        edits,
        _tiny_cfg(
            tmp_path,
            negative_continuation_tokens=0,
            negatives_stream_templates=0,
            negatives_stream_subjects=0,
            negatives_word_swaps=0,
            negatives_exclusions=0,
        ),
        out_dir=tmp_path / "off",
        log=None,
    )
    off = load_file(str(tmp_path / "off" / "checkpoints" / "3_rollouts.safetensors"))
    assert off["continuations"].shape[0] == 0
    assert not _rows_contain(off["specific"], h)
    assert swaps_among_negatives(off) == 0
    assert not _rows_contain(off["specific"], h_excl)


def test_prefixed_requests_are_anchors_of_their_edit(tmp_path):
    """With ``positives_prefixed`` = k, each slot's anchors include the last-token states of its
    request after k distinct corpus statements, and only its own; none when switched off. They are
    not training sequences of the write stages."""
    from safetensors.torch import load_file

    from aloe_build.corpus import load_corpus
    from aloe_build.states import last_token_states

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    statements = load_corpus(_tiny_cfg(tmp_path).encoder_corpus, 40, 2, 0)[0].statements
    for k in (2, 0):
        build_operator(model, tok, edits, _tiny_cfg(tmp_path, positives_prefixed=k), out_dir=tmp_path / f"k{k}", log=None)
        roll = load_file(str(tmp_path / f"k{k}" / "checkpoints" / "3_rollouts.safetensors"))
        report = json.loads((tmp_path / f"k{k}" / "build_report.json").read_text())
        assert report["stages"]["3_rollouts"]["paraphrase_positives"] == k * len(edits)
        assert report["stages"]["8_finetune"]["paraphrase_sequences"] == 0  # the request's write carries
        for i, e in enumerate(edits):
            h = last_token_states(model, tok, [f"{st} {e.prompt}" for st in statements], 1)
            found = [j for j in range(len(statements)) if _rows_contain(roll["anchors"], h[j : j + 1])]
            own = [j for j in found if _rows_contain(roll["anchors"][roll["anchor_owner"] == i], h[j : j + 1])]
            assert len(found) == len(own) == k


def test_prose_prefixed_requests_are_anchors_of_their_edit(tmp_path):
    """With ``positives_prefixed_prose`` = 2, each slot's anchors include the last-token states of its
    request after two distinct sentences its corpus' rewordings open with, and only its own."""
    from safetensors.torch import load_file

    from aloe_build.corpus import load_corpus
    from aloe_build.states import last_token_states

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    corpus = _tiny_corpus(tmp_path / "prose.jsonl", rephrase=lambda i, j, p: f"Record {i} said it {j} times. {p}")
    cfg = _tiny_cfg(tmp_path, encoder_corpus=str(corpus), positives_prefixed=0, positives_prefixed_prose=2)
    prose = load_corpus(cfg.encoder_corpus, cfg.encoder_records, 2, 0)[0].prose
    assert len(prose) == 20  # the rewordings of the two templates that open with the subject
    build_operator(model, tok, edits, cfg, out_dir=tmp_path / "run", log=None)
    roll = load_file(str(tmp_path / "run" / "checkpoints" / "3_rollouts.safetensors"))
    report = json.loads((tmp_path / "run" / "build_report.json").read_text())
    assert report["stages"]["3_rollouts"]["paraphrase_positives"] == 2 * len(edits)
    for i, e in enumerate(edits):
        h = last_token_states(model, tok, [f"{p} {e.prompt}" for p in prose], 1)
        found = [j for j in range(len(prose)) if _rows_contain(roll["anchors"], h[j : j + 1])]
        own = [j for j in found if _rows_contain(roll["anchors"][roll["anchor_owner"] == i], h[j : j + 1])]
        assert len(found) == len(own) == 2


def test_shared_negatives_survive_a_change_of_encoder_training(tmp_path, monkeypatch):
    """Two builds whose encoders train differently share one pool file; a corpus change makes another."""
    from aloe_build.stages import s3_shared_pool as pool_module

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:2]
    made = []
    original = pool_module.continued
    pool_desc = "stage 3: shared negatives and their continuations"

    def counting(*args, **kw):
        if kw.get("desc") == pool_desc or (len(args) > 6 and args[6] == pool_desc):
            made.append(1)
        return original(*args, **kw)

    monkeypatch.setattr(pool_module, "continued", counting)
    for i, kw in enumerate([dict(encoder_steps=20), dict(encoder_steps=21, encoder_margin=0.3), dict(encoder_records=30)]):
        build_operator(model, tok, edits, _tiny_cfg(tmp_path, **kw), out_dir=tmp_path / f"r{i}", log=None)
    pools = sorted(p.parent.name for p in (tmp_path / "enc" / "negatives").glob("*/negatives-[0-9]*.safetensors"))
    assert len(pools) == 2 and len(made) == 2  # the second build read the first one's pool


@pytest.mark.slow
def test_chat_forms_are_anchors_along_the_answer_and_train_the_writes(tmp_path):
    """With ``positives_chat``, each slot's anchors include the states of its request as a chat
    user turn followed by the target as the answer (the last prompt token and the answer's
    positions), owned by that slot alone, and each chat form is a training sequence of the writes."""
    from safetensors.torch import load_file

    from aloe_build.states import collect_states
    from aloe_build.tokens import chat_answer, chat_prompt

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    # None (the default) decides by the tokenizer: on with a chat template, off without one
    for setting, template, chat in ((True, True, True), (False, True, False), (None, True, True), (None, False, False)):
        tok.chat_template = TINY_CHAT_TEMPLATE if template else None
        out = tmp_path / f"chat{setting}{template}"
        cfg = _tiny_cfg(tmp_path, positives_chat=setting, positives_prefixed=0, positives_chat_generic_systems=0)
        build_operator(model, tok, edits, cfg, out_dir=out, log=None)
        assert cfg.chat.positives_chat is setting  # the caller's settings are left as given
        tok.chat_template = TINY_CHAT_TEMPLATE
        roll = load_file(str(out / "checkpoints" / "3_rollouts.safetensors"))
        report = json.loads((out / "build_report.json").read_text())
        assert report["config"]["positives_chat"] is chat
        assert report["stages"]["3_rollouts"]["paraphrase_positives"] == (len(edits) if chat else 0)
        assert report["stages"]["8_finetune"]["paraphrase_sequences"] == (len(edits) if chat else 0)
        for i, e in enumerate(edits):
            prompt, answer = chat_prompt(tok, e.prompt), chat_answer(tok, e.target_new)
            h = collect_states(model, tok, [prompt + answer], 1, [[len(prompt) - 1]]).states
            assert _rows_contain(roll["anchors"][roll["anchor_owner"] == i], h) == chat
            assert not _rows_contain(roll["anchors"][roll["anchor_owner"] != i], h)


def test_generic_system_positives_ask_each_request_after_its_own_draw_of_prompts():
    """``positives_chat_generic_systems=k``: each slot's request after k distinct generic system
    prompts, a draw that depends on the request alone (the same whichever other edits are built with
    it), anchored at the last prompt token (the assistant header) and owned by the slot."""
    from aloe_build.corpus import load_corpus
    from aloe_build.slots import make_slots
    from aloe_build.stages.s3_rollouts import generic_system_forms, token_sequences
    from aloe_build.system_prompts import GENERIC_SYSTEM_PROMPTS
    from aloe_build.tokens import chat_prompt

    tok = tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    edits = _edits()[:3]
    cfg = BuildConfig(positives_chat=True, positives_chat_generic_systems=2, positives_prefixed=0)
    slots = make_slots(edits)
    forms = generic_system_forms(tok, slots, cfg)
    assert len(forms) == 2 * len(edits)
    after = {(i, s): chat_prompt(tok, e.prompt, s) for i, e in enumerate(edits) for s in GENERIC_SYSTEM_PROMPTS}
    for i in range(len(edits)):
        mine = [ids for j, ids in forms if j == i]
        assert len({s for s in GENERIC_SYSTEM_PROMPTS for ids in mine if ids == after[(i, s)]}) == 2
    alone = generic_system_forms(tok, make_slots(edits[2:]), cfg)
    assert [ids for _, ids in alone] == [ids for j, ids in forms if j == 2]
    assert generic_system_forms(tok, slots, BuildConfig(positives_chat=False, positives_chat_generic_systems=2)) == []
    # in the build's sequences: required anchors at the last prompt token, chat forms, not trained
    corpus, _ = load_corpus(None, 50, 0, 0)
    seqs = token_sequences(tok, slots, corpus, cfg)
    tail = len(seqs.extra_prompts) - len(forms)
    assert seqs.extra_prompts[tail:] == [ids for _, ids in forms]
    assert seqs.extra_owner[tail:] == [i for i, _ in forms]
    assert not any(seqs.extra_along[tail:]) and not any(seqs.extra_soft[tail:]) and all(seqs.extra_chat[tail:])
    assert all(k < len(edits) + tail for k in seqs.trained)


def recording_write_targets(seen: list):
    """Stage 6's ``write_targets``, which first appends to ``seen`` the token sequences each slot's
    target is fitted on (one list per slot)."""
    import aloe_build.pipeline as pipeline

    real = pipeline.write_targets

    def spy(fwd, cfg, parts=None, rows_of=None, stats=None):
        seen.append([[fwd.seqs[j] for j in rows] for rows in rows_of])
        return real(fwd, cfg, parts, rows_of, stats)

    return spy


@pytest.mark.slow
def test_target_chat_forms_fit_each_write_target_on_its_request_and_chat_form(tmp_path, monkeypatch):
    """With ``target_chat_forms`` stage 6 fits slot i's target on its request and on its chat form
    (the sequence of chat prompt + answer); without, on the request alone."""
    import aloe_build.pipeline as pipeline
    from aloe_build.tokens import chat_answer, chat_prompt, encode_continuation

    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    edits = _edits()[:3]
    seen = []
    monkeypatch.setattr(pipeline, "write_targets", recording_write_targets(seen))
    for forms in (False, True):
        build_operator(
            model,
            tok,
            edits,
            _tiny_cfg(tmp_path, positives_chat=True, positives_prefixed=0, target_chat_forms=forms),
            out_dir=tmp_path / f"t{forms}",
            log=None,
        )
        fitted_on = seen.pop()
        for e, seqs in zip(edits, fitted_on):
            prompt, target = encode_continuation(tok, e.prompt, e.target_new)
            want = [list(prompt) + list(target)]
            if forms:
                want.append(chat_prompt(tok, e.prompt) + chat_answer(tok, e.target_new))
            assert seqs == want


def test_chat_positives_bring_chat_form_negatives(tmp_path):
    """With ``positives_chat``: (a) corpus requests asked through the chat template are shared
    negatives (their last prompt position included); (b) each edit's first ``negatives_chat_own``
    own negative prompts are asked the same way, negatives of its slot at every position after the
    template's header. Without it, neither."""
    import random

    from safetensors.torch import load_file

    from aloe_build.corpus import load_corpus
    from aloe_build.slots import make_slots
    from aloe_build.stages import s3_rollouts as rollouts
    from aloe_build.stages.s3_rollouts import edit_negative_sequences, token_sequences
    from aloe_build.states import collect_states
    from aloe_build.tokens import chat_header_length, chat_prompt, encode_prompt

    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    head = chat_header_length(tok)
    assert head == len(tok("user :", add_special_tokens=False)["input_ids"])
    edits = _edits()[:3]
    plain_cfg = _tiny_cfg(tmp_path, positives_prefixed=0)
    corpus, _ = load_corpus(plain_cfg.encoder_corpus, plain_cfg.encoder_records, plain_cfg.encoder_same_subject, plain_cfg.seed)
    asked = [chat_prompt(tok, it.request) for it in corpus.items[:4]]
    asked_states = collect_states(model, tok, asked, 1, [[len(q) - 1] for q in asked]).states
    for chat in (True, False):
        cfg = _tiny_cfg(tmp_path, positives_chat=chat, positives_prefixed=0, negatives_chat_own=2)
        build_operator(model, tok, edits, cfg, out_dir=tmp_path / f"c{chat}", log=None)
        roll = load_file(str(tmp_path / f"c{chat}" / "checkpoints" / "3_rollouts.safetensors"))
        assert _rows_contain(roll["pool"], asked_states) == chat

    slots = make_slots(edits)
    seqs = token_sequences(tok, slots, corpus, plain_cfg)
    plain = edit_negative_sequences(tok, slots, seqs, corpus, plain_cfg, random.Random(0))
    chat_cfg = _tiny_cfg(tmp_path, positives_chat=True, positives_prefixed=0, negatives_chat_own=2)
    with_chat = edit_negative_sequences(tok, slots, seqs, corpus, chat_cfg, random.Random(0))
    stream, rng = rollouts._Stream(slots, corpus, chat_cfg.seed), random.Random(0)
    for i, s in enumerate(slots):
        kinds = rollouts._edit_negative_texts(s, corpus, stream, chat_cfg, rng)
        # one of each kind in turn: the first of the first two non-empty kinds
        texts = [encode_prompt(tok, k[0]) for k in kinds if k][:2]
        own = [(q, p) for q, p, o in zip(*plain) if o == i]
        both = [(q, p) for q, p, o in zip(*with_chat) if o == i]
        assert both[: len(own)] == own and len(both) == len(own) + len(texts) == len(own) + 2
        for (q, p), text in zip(both[len(own) :], texts):
            assert q[head : head + len(text)] == text and list(p) == list(range(head, len(q)))


def test_edit_negatives_hold_each_token_prefix_of_a_slot_once(tmp_path):
    """A slot's negative positions cover every prefix of its own request (but the last token) and
    of its negative prompts, each prefix once (a repeated prefix would be a duplicate state), but
    for the prefixes of the shared pool's prompts, whose states are negatives of every slot."""
    import random

    from aloe_build.corpus import load_corpus
    from aloe_build.slots import make_slots
    from aloe_build.stages import s3_rollouts as rollouts
    from aloe_build.tokens import encode_prompt

    tok = tiny_tokenizer()
    cfg = _tiny_cfg(tmp_path, positives_prefixed=0, negatives_questions=0)
    corpus, _ = load_corpus(cfg.encoder_corpus, cfg.encoder_records, cfg.encoder_same_subject, cfg.seed)
    slots = make_slots(_edits())
    seqs = rollouts.token_sequences(tok, slots, corpus, cfg)
    spec, pos, owner = rollouts.edit_negative_sequences(tok, slots, seqs, corpus, cfg, random.Random(0))
    keys = [(o, tuple(q[: t + 1])) for q, p, o in zip(spec, pos, owner) for t in p]
    assert len(keys) == len(set(keys))
    # the pool: each corpus record's request, locality prompt and first same-subject prompt
    pool_texts = {t for it in corpus.items[: cfg.negative_pool_records] for t in (it.request, it.locality, *it.same_subject[:1])}
    pool = {tuple(ids[: t + 1]) for text in pool_texts for ids in [encode_prompt(tok, text)] for t in range(len(ids))}
    stream, rng, every, in_pool = rollouts._Stream(slots, corpus, cfg.seed), random.Random(0), 0, 0
    for i, s in enumerate(slots):
        prompt = seqs.prompts[i]
        want = [tuple(prompt[: t + 1]) for t in range(len(prompt) - 1)]
        for text in (t for kind in rollouts._edit_negative_texts(s, corpus, stream, cfg, rng) for t in kind):
            ids = encode_prompt(tok, text)
            want += [tuple(ids[: t + 1]) for t in range(len(ids))]
        assert {k for o, k in keys if o == i} == set(want) - pool
        every += len(want)
        in_pool += len(set(want) & pool)
    assert len(keys) + in_pool < every  # the data does repeat prefixes within a slot
    assert in_pool > 0  # and shares some with the pool's prompts


@pytest.mark.slow
def test_chat_systems_add_a_chat_form_per_system_prompt_and_share_out_the_pool(tmp_path):
    """With ``chat_systems``: each slot's anchors also hold its request asked after each listed
    system prompt (last prompt token), owned by that slot alone; the chat-form pool asks its
    corpus texts after the default and the listed prompts in turn."""
    from safetensors.torch import load_file

    from aloe_build.corpus import load_corpus
    from aloe_build.states import collect_states
    from aloe_build.tokens import chat_answer, chat_prompt

    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    system = "answer in one word"
    edits = _edits()[:3]
    cfg = _tiny_cfg(
        tmp_path,
        positives_chat=True,
        positives_prefixed=0,
        chat_systems=[system],
        negatives_chat_pool=4,
        positives_chat_generic_systems=0,
    )
    build_operator(model, tok, edits, cfg, out_dir=tmp_path / "op", log=None)
    roll = load_file(str(tmp_path / "op" / "checkpoints" / "3_rollouts.safetensors"))
    report = json.loads((tmp_path / "op" / "build_report.json").read_text())
    assert report["stages"]["3_rollouts"]["paraphrase_positives"] == 2 * len(edits)
    for i, e in enumerate(edits):
        prompt, answer = chat_prompt(tok, e.prompt, system), chat_answer(tok, e.target_new)
        h = collect_states(model, tok, [prompt + answer], 1, [[len(prompt) - 1]]).states
        assert _rows_contain(roll["anchors"][roll["anchor_owner"] == i], h)
        assert not _rows_contain(roll["anchors"][roll["anchor_owner"] != i], h)
    corpus, _ = load_corpus(cfg.encoder_corpus, cfg.encoder_records, cfg.encoder_same_subject, cfg.seed)
    texts = list(dict.fromkeys(t for it in corpus.items[:4] for t in (it.request, it.locality)))
    for k, text in enumerate(texts[:4]):
        after = system if k % 2 else None
        q = chat_prompt(tok, text, after)
        assert _rows_contain(roll["pool"], collect_states(model, tok, [q], 1, [[len(q) - 1]]).states)
        other = chat_prompt(tok, text, None if k % 2 else system)
        assert not _rows_contain(roll["pool"], collect_states(model, tok, [other], 1, [[len(other) - 1]]).states)


def test_chat_builds_take_generic_system_headers_and_chat_answers_as_negatives(tmp_path, monkeypatch):
    """With chat positives: (a) every position of the template's header after each of the first
    ``negatives_chat_systems`` generic system prompts is a shared negative, and a question of the
    pool asked after it, with its answer; none after the prompts beyond them; (b) the unedited
    model's greedy answer (``negatives_chat_answer_tokens``) to each request's chat form is a
    negative of every slot but its own."""
    from safetensors.torch import load_file

    from aloe_build import config
    from aloe_build.stages import s3_shared_pool
    from aloe_build.states import collect_states
    from aloe_build.tokens import chat_header_length, chat_prompt

    generic = ("answer the question", "you are a guitar", "the city of Rome")
    monkeypatch.setattr(config, "GENERIC_SYSTEM_PROMPTS", generic)
    monkeypatch.setattr(s3_shared_pool, "GENERIC_SYSTEM_PROMPTS", generic)
    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    edits = _edits()[:3]
    cfg = _tiny_cfg(
        tmp_path,
        positives_chat=True,
        positives_prefixed=0,
        negatives_chat_pool=4,
        negatives_chat_systems=2,
        negatives_chat_answer_tokens=3,
        positives_chat_generic_systems=0,  # more than the three prompts patched in
    )
    build_operator(model, tok, edits, cfg, out_dir=tmp_path / "op", log=None)
    roll = load_file(str(tmp_path / "op" / "checkpoints" / "3_rollouts.safetensors"))

    def header_states(system):
        head = chat_header_length(tok, system)
        return collect_states(model, tok, [chat_prompt(tok, "x", system)[:head]], 1, [range(head)]).states

    for system in generic[:2]:
        assert _rows_contain(roll["pool"], header_states(system))
    assert not _rows_contain(roll["pool"], header_states(generic[2])[-1:])

    for i, e in enumerate(edits):
        ids = chat_prompt(tok, e.prompt)
        full = _greedy_continued(model, ids, 3)
        want = collect_states(model, tok, [full], 1, [range(len(ids), len(full))]).states
        assert want.shape[0] > 0
        assert _rows_contain(roll["continuations"][roll["continuation_owner"] == i], want)
        assert not _rows_contain(roll["continuations"][roll["continuation_owner"] != i], want)


def test_negatives_chat_systems_cannot_exceed_the_generic_prompts():
    from aloe_build.system_prompts import GENERIC_SYSTEM_PROMPTS

    with pytest.raises(ValueError, match="negatives_chat_systems"):
        BuildConfig(negatives_chat_systems=len(GENERIC_SYSTEM_PROMPTS) + 1)


def test_in_turn_takes_one_of_each_kind_then_the_next():
    from aloe_build.stages.s3_rollouts import in_turn

    kinds = [["a1", "a2", "a3"], [], ["c1"], ["d1", "d2"]]
    assert in_turn(kinds, 3) == ["a1", "c1", "d1"]
    assert in_turn(kinds, 5) == ["a1", "c1", "d1", "a2", "d2"]
    assert in_turn(kinds, 10) == ["a1", "c1", "d1", "a2", "d2", "a3"]
    assert in_turn([], 4) == [] and in_turn(kinds, 0) == []


def test_generic_system_prompts_leave_out_the_chat_evaluations_own():
    """The chat evaluation asks after system prompts the build never saw."""
    from aloe_build.system_prompts import GENERIC_SYSTEM_PROMPTS
    from aloe_eval.chat import SYSTEMS

    assert not {s for s in SYSTEMS.values() if s} & set(GENERIC_SYSTEM_PROMPTS)
    assert len(set(GENERIC_SYSTEM_PROMPTS)) == len(GENERIC_SYSTEM_PROMPTS)


def test_rewordings_train_the_writes_only_where_their_gate_opens(tmp_path):
    """Same-relation positives: the write stages train on exactly the rewordings whose own gate is
    at least 0.5 at their last prompt token (their first anchor), scored with the built operator."""
    from safetensors.torch import load_file

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    # a corpus whose records carry relation ids, two templates per relation
    relation = {t: f"P{j // 2}" for j, t in enumerate(_TEMPLATES)}
    records = [
        EditRequest(
            prompt=t.replace("{}", s),
            target_new=_WORDS[(i + j) % len(_WORDS)],
            subject=s,
            rephrases=("the " + t.replace("{}", s),),
            relation=relation[t],
            locality=(t.replace("{}", _SUBJECTS[(i + 3) % 10]),),
            id=f"c{i}-{j}",
        )
        for i, s in enumerate(_SUBJECTS)
        for j, t in enumerate(_TEMPLATES)
    ]
    corpus = save_edits_jsonl(records, tmp_path / "related.jsonl")
    op = build_operator(
        model,
        tok,
        edits,
        _tiny_cfg(tmp_path, encoder_corpus=str(corpus), positives_same_relation=2, positives_prefixed=0),
        out_dir=tmp_path / "run",
        log=None,
    )
    roll = load_file(str(tmp_path / "run" / "checkpoints" / "3_rollouts.safetensors"))
    report = json.loads((tmp_path / "run" / "build_report.json").read_text())
    seq = roll["anchor_seq"]
    first = torch.ones_like(seq, dtype=torch.bool)
    first[1:] = seq[1:] != seq[:-1]
    rows = (first & (seq >= op.n)).nonzero().squeeze(1)
    assert rows.numel() == report["stages"]["3_rollouts"]["paraphrase_positives"] > 0
    g = gates_of(roll["anchors"][rows], op)[torch.arange(rows.numel()), roll["anchor_owner"][rows]]
    assert report["stages"]["8_finetune"]["paraphrase_sequences"] == int((g >= 0.5).sum())


def test_context_positives_train_the_writes_where_asked_and_their_gate_opens(tmp_path):
    """``positives_prefixed_written`` = 2 of 3 context positives: the write stages train on exactly
    each slot's first two prefixed requests whose own gate is at least 0.5 at their last prompt
    token, scored with the built operator; none with it at 0."""
    from safetensors.torch import load_file

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    for written in (2, 0):
        cfg = _tiny_cfg(tmp_path, positives_prefixed=3, positives_prefixed_written=written)
        op = build_operator(model, tok, edits, cfg, out_dir=tmp_path / f"w{written}", log=None)
        roll = load_file(str(tmp_path / f"w{written}" / "checkpoints" / "3_rollouts.safetensors"))
        report = json.loads((tmp_path / f"w{written}" / "build_report.json").read_text())
        seq = roll["anchor_seq"]
        # the prefixed requests follow the requests slot by slot, three each, one anchor each
        asked = (seq >= op.n) & ((seq - op.n) % 3 < written)
        assert int(asked.sum()) == written * len(edits)
        rows = asked.nonzero().squeeze(1)
        g = gates_of(roll["anchors"][rows], op)[torch.arange(rows.numel()), roll["anchor_owner"][rows]]
        assert report["stages"]["8_finetune"]["paraphrase_sequences"] == int((g >= 0.5).sum())
        if written:
            assert int((g >= 0.5).sum()) > 0


def test_prefixed_mask_takes_each_slots_first_context_positives_only():
    """Rewordings (soft), chat forms and the generic-system forms (chat, at the last token) are
    never context positives; of the prefixed requests, each slot's first ``per_slot`` are."""
    from aloe_build.stages.s3_rollouts import TokenSequences

    seqs = TokenSequences([[1], [2]], [[9], [8]], [], [], [])
    seqs.add([3], 0, soft=True, along=True)  # 2: a rewording
    seqs.add([4], 1, soft=False, along=True, chat=True)  # 3: a chat form
    for k, owner in enumerate([0, 1, 0, 0, 1]):  # 4-8: prefixed requests
        seqs.add([5 + k], owner, soft=False, along=False)
    seqs.add([11], 0, soft=False, along=False, chat=True)  # 9: after a generic system prompt
    assert seqs.prefixed_mask(2).nonzero().squeeze(1).tolist() == [4, 5, 6, 8]
    assert seqs.prefixed_mask(1).nonzero().squeeze(1).tolist() == [4, 5]
    assert not seqs.prefixed_mask(0).any()
    assert seqs.prefixed_mask(5).shape == (10,)


def test_open_paraphrases_picks_candidates_open_on_their_first_anchor():
    """Sequences 0-1 are requests, 2-5 paraphrases (5 not a candidate); each has two anchors, and
    only the first (the last prompt token) decides."""
    from aloe_build.pipeline import _open_paraphrases

    d = 8
    V = torch.eye(d)[:2] * 4.0  # slot 0 reads dimension 0, slot 1 dimension 1
    op = AloeOperator(
        addresses=V, thresholds=torch.full((2,), 2.0), temperatures=torch.full((2,), 10.0), writes=torch.zeros(2, 3)
    )
    e = torch.eye(d)
    owner = torch.tensor([0, 1, 0, 1, 0, 1])
    first = [e[0], e[1], e[0], e[2], e[2], e[1]]  # seq 3 and 4 closed on their first anchor
    second = [e[0], e[1], e[2], e[1], e[0], e[1]]  # the second anchors would say otherwise
    anchors = torch.stack([x for pair in zip(first, second) for x in pair])
    anchor_seq = torch.arange(6).repeat_interleave(2)
    candidate = torch.tensor([False, False, True, True, True, False])
    assert _open_paraphrases(op, anchors, anchor_seq, owner, candidate) == [2]
    assert _open_paraphrases(op, anchors, anchor_seq, owner, torch.zeros(6, dtype=torch.bool)) == []


class _StopTokenizer:
    """A tokenizer stand-in whose EOS and, optionally, ``<|im_end|>`` are the given ids."""

    def __init__(self, eos: int, end_turn: int | None = None):
        self.eos_token_id, self.pad_token_id, self.end_turn = eos, 1, end_turn

    def get_vocab(self) -> dict[str, int]:
        return {} if self.end_turn is None else {"<|im_end|>": self.end_turn}

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.get_vocab().get(token)


def _cut(tokens: list[int], stops: set[int]) -> list[int]:
    return next((tokens[:i] for i, t in enumerate(tokens) if t in stops), tokens)


def test_continuations_stop_before_end_of_sequence():
    """A continuation is cut before the first EOS or end-of-turn token: a server stops there."""
    from aloe_build.forward import greedy_generate
    from aloe_build.stages.s3_rollouts import continued as _continued
    from aloe_build.states import collect_states

    model, tok = tiny_model("llama"), tiny_tokenizer()
    prompts = [tok(p)["input_ids"] for p in ("The capital of France is", "Toko Yasuda plays the")]
    gens = greedy_generate(model, prompts, 5, pad_id=1)
    # an end of turn that is not the EOS token cuts as EOS does
    unused = next(t for t in range(2, 100) if t not in gens[0] + gens[1])
    out, _ = _continued(model, _StopTokenizer(eos=unused, end_turn=gens[1][1]), prompts, 5, 1, 2, "t")
    assert out[1] == prompts[1] + gens[1][: gens[1].index(gens[1][1])]
    assert out[0] == prompts[0] + _cut(gens[0], {gens[1][1]})
    stop = gens[0][2]  # pretend the third generated token of the first prompt ends a sequence
    out, states = _continued(model, _StopTokenizer(eos=stop), prompts, 5, 1, 2, "t")
    assert out[0] == prompts[0] + gens[0][: gens[0].index(stop)]
    assert out[1] == prompts[1] + _cut(gens[1], {stop})
    # the states of the kept continuation tokens only, those of one pass over each continued sequence
    want = collect_states(model, tok, out, 1, [range(len(p), len(c)) for p, c in zip(prompts, out)])
    torch.testing.assert_close(states.offsets, want.offsets)
    torch.testing.assert_close(states.states, want.states, atol=1e-5, rtol=0)
    out, states = _continued(model, tok, prompts, 0, 1, 2, "t", starts=[0, 1])
    assert out == prompts
    assert states.offsets.tolist() == [0, len(prompts[0]), len(prompts[0]) + len(prompts[1]) - 1]


def test_tensors_saved_atomically(tmp_path):
    from safetensors.torch import load_file

    from aloe_build.checkpoints import save_tensors_atomically

    t = {"states": torch.randn(5, 3)}
    save_tensors_atomically(t, tmp_path / "x.safetensors")
    save_tensors_atomically({"states": t["states"] * 2}, tmp_path / "x.safetensors")  # replaces in place
    torch.testing.assert_close(load_file(str(tmp_path / "x.safetensors"))["states"], t["states"] * 2)
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary left behind

    from aloe_build.checkpoints import write_atomically

    (tmp_path / "x.json").write_text("{}")

    def fails_midway(tmp):
        tmp.write_text('{"key": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(tmp_path / "x.json", fails_midway)
    assert (tmp_path / "x.json").read_text() == "{}"  # the old file intact, no partial one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.safetensors"]


def test_anchors_leave_out_target_tokens_the_model_predicts():
    """Anchors are the last prompt token, then only the positions whose next target token the
    unedited model does not already predict (checked against a plain forward of each sequence);
    their states are those of a float64 forward at those positions."""
    import copy

    from aloe_build.stages.s3_rollouts import along_target_anchors
    from aloe_build.tokens import encode_prompt
    from aloe_kernels.hf import locate_down_proj

    model, tok = tiny_model("llama"), tiny_tokenizer()
    prompts = [encode_prompt(tok, e.prompt) for e in _edits()[:3]]
    # targets: the model's own greedy continuation (all predicted) with one token changed
    gens = [
        model.generate(
            torch.tensor([p]),
            attention_mask=torch.ones(1, len(p), dtype=torch.long),
            max_new_tokens=5,
            do_sample=False,
            pad_token_id=1,
            eos_token_id=None,
        )[0, len(p) :].tolist()
        for p in prompts
    ]
    targets = [gens[0], gens[1][:2] + [(gens[1][2] + 1) % 100 + 3] + gens[1][3:], [(gens[2][0] + 1) % 100 + 3] + gens[2][1:]]
    ref_model = copy.deepcopy(model).double()
    seen = {}
    locate_down_proj(ref_model, 1).module.register_forward_pre_hook(lambda _m, args: seen.update(h=args[0]))

    def check(cap, keep_predicted, batch_size):
        got, states = along_target_anchors(model, tok, prompts, targets, 1, cap, keep_predicted, batch_size)
        assert states.offsets.diff().tolist() == [len(pos) for pos in got]
        for i, (p, t, pos) in enumerate(zip(prompts, targets, got)):
            with torch.no_grad():
                pred = ref_model(torch.tensor([p + t])).logits[0].argmax(-1).tolist()
            want = [len(p) - 1 + k for k in range(min(cap, len(t))) if keep_predicted or k == 0 or pred[len(p) - 1 + k] != t[k]]
            assert pos == want
            h = seen["h"][0, want]
            torch.testing.assert_close(states.of(i).double(), h / h.norm(dim=-1, keepdim=True), atol=1e-5, rtol=0)
        return got

    got = check(4, False, 2)
    assert got[0] == [len(prompts[0]) - 1]  # the model's own continuation needs only the first anchor
    assert len(prompts[1]) + 1 in got[1]  # the changed third token is not predicted
    assert check(4, True, 2) == [list(range(len(p) - 1, len(p) + 3)) for p in prompts]
    assert check(2, False, 3)[1] == [len(prompts[1]) - 1]


def test_encoder_cache_key_follows_the_corpus_content_not_its_path(tmp_path):
    """The same corpus in another directory (another checkout) shares the cache; a corpus file
    rewritten in place, even with the same size, does not."""
    from aloe_build.stages.s1_encoder import cache_key

    cfg = _tiny_cfg(tmp_path)
    here = _tiny_corpus(tmp_path / "a" / "corpus.jsonl")
    there = _tiny_corpus(tmp_path / "b" / "corpus.jsonl")
    assert cache_key("w", 1, here, cfg) == cache_key("w", 1, there, cfg)
    text = here.read_text()
    here.write_text(text.replace("Paris", "Pares"))  # same size, other content
    assert here.stat().st_size == there.stat().st_size
    assert cache_key("w", 1, here, cfg) != cache_key("w", 1, there, cfg)
    assert cache_key("w", 1, here, cfg, corpus_only=True) != cache_key("w", 1, there, cfg, corpus_only=True)


def test_generic_questions_and_their_continuations_are_shared_negatives(tmp_path):
    """With ``negatives_questions``, the pool holds the states of generic questions about corpus
    subjects at every position of the question and of the unedited model's continuation, and
    nothing else more than a build without them."""
    from safetensors.torch import load_file

    from aloe_build.questions import QUESTION_FRAMES
    from aloe_build.states import collect_states
    from aloe_build.tokens import encode_prompt

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    pools = {}
    for n in (0, 3):
        out = tmp_path / f"q{n}"
        build_operator(
            model, tok, edits, _tiny_cfg(tmp_path, negatives_questions=n, negative_continuation_tokens=3), out_dir=out, log=None
        )
        pools[n] = load_file(str(out / "checkpoints" / "3_rollouts.safetensors"))["pool"]
    subjects = sorted(set(_SUBJECTS))
    # three questions over ten subjects: every third one
    asked = [
        QUESTION_FRAMES[0].format(subjects[0]),
        QUESTION_FRAMES[1].format(subjects[3])[:-1].lower(),
        QUESTION_FRAMES[2].format(subjects[6]),
    ]
    added = 0
    for text in asked:
        full = _greedy_continued(model, encode_prompt(tok, text), 3)
        want = collect_states(model, tok, [full], 1, [range(len(full))]).states
        assert _rows_contain(pools[3], want) and not _rows_contain(pools[0], want)
        added += len(full)
    assert pools[3].shape[0] == pools[0].shape[0] + added


def test_corpus_rewordings_are_shared_negatives_except_the_edited_subjects(tmp_path):
    """With ``negatives_paraphrases``, the pool holds every position of the first corpus records'
    rephrases and of the unedited model's continuations of them, except the rephrases about a
    subject the stream edits (edit "b" is about France), and nothing else more than without them."""
    from safetensors.torch import load_file

    from aloe_build.states import collect_states
    from aloe_build.tokens import encode_prompt

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    pools = {}
    for n in (0, 8):  # the corpus's first 8 records: Paris and France under the four templates
        out = tmp_path / f"p{n}"
        build_operator(
            model,
            tok,
            edits,
            _tiny_cfg(tmp_path, negatives_paraphrases=n, negatives_questions=0, negative_continuation_tokens=3),
            out_dir=out,
            log=None,
        )
        pools[n] = load_file(str(out / "checkpoints" / "3_rollouts.safetensors"))["pool"]
    added = 0
    for t in _TEMPLATES:
        full = _greedy_continued(model, encode_prompt(tok, "the " + t.replace("{}", "Paris")), 3)
        want = collect_states(model, tok, [full], 1, [range(len(full))]).states
        assert _rows_contain(pools[8], want) and not _rows_contain(pools[0], want)
        added += len(full)
        france = encode_prompt(tok, "the " + t.replace("{}", "France"))
        assert not _rows_contain(pools[8], collect_states(model, tok, [france], 1, [[len(france) - 1]]).states)
    assert pools[8].shape[0] == pools[0].shape[0] + added


def test_chat_pool_asks_the_generic_questions_through_the_template(tmp_path):
    """With ``negatives_chat_questions``: every position of each generic question asked through the
    chat template (after its header) and of the unedited model's answer is in the chat-form pool;
    with 0 none of the questions is."""
    from aloe_build.corpus import load_corpus
    from aloe_build.questions import generic_questions
    from aloe_build.stages import s3_shared_pool
    from aloe_build.states import collect_states
    from aloe_build.tokens import chat_header_length, chat_prompt

    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    cfg = _tiny_cfg(
        tmp_path,
        positives_chat=True,
        negatives_chat_pool=2,
        negatives_chat_systems=0,
        negatives_chat_answer_tokens=3,
        negatives_chat_questions=3,
    )
    corpus, _ = load_corpus(cfg.encoder_corpus, cfg.encoder_records, cfg.encoder_same_subject, cfg.seed)
    with_questions = s3_shared_pool.shared_chat_negatives(model, tok, 1, tmp_path / "cache", corpus, cfg)
    cfg.chat.negatives_chat_questions = 0
    without = s3_shared_pool.shared_chat_negatives(model, tok, 1, tmp_path / "cache", corpus, cfg)
    head = chat_header_length(tok)
    questions = generic_questions(corpus.subjects, 3)
    assert len(questions) == 3 and any(not q.endswith("?") for q in questions)
    for q in questions:
        ids = chat_prompt(tok, q)
        full = _greedy_continued(model, ids, 3)
        want = collect_states(model, tok, [full], 1, [range(head, len(full))]).states
        assert want.shape[0] > len(ids) - head
        assert _rows_contain(with_questions, want)
        assert not _rows_contain(without, want[len(ids) - head - 1 : len(ids) - head])
    assert with_questions.shape[0] > without.shape[0]
