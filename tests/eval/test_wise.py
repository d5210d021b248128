"""WISE: routing, margins, TIES merging, shards, the target loss, fitting and attach/detach."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from eval_helpers import tiny_requests
from helpers import stopping_at
from tiny_models import tiny_model, tiny_tokenizer
from torch import nn

from aloe_eval.baselines.wise import WiseConfig, WiseEditor, fit_wise, wise_layer
from aloe_eval.baselines.wise_checkpoint import WiseState
from aloe_eval.baselines.wise_fit import after_edit
from aloe_eval.baselines.wise_inputs import edit_batch, target_loss
from aloe_eval.baselines.wise_merge import ties_merge
from aloe_eval.baselines.wise_router import WiseDownProj
from aloe_eval.baselines.wise_train import Margins, UpperForward, margin_loss
from aloe_kernels.hf import locate_down_proj

LAYER = 1
UNRELATED = ["Toko Yasuda plays the piano ."]
PREFIXES = ["", "The capital of Italy is Rome . "]


@pytest.fixture()
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


def _score(W_main, W_side, h):
    """One sequence's activation score by hand: the mean over its tokens of ||silu(W_s a) - silu(W_m a)||."""
    per_token = [float(torch.norm(F.silu(W_side @ a) - F.silu(W_main @ a))) for a in h]
    return sum(per_token) / len(per_token)


def _router(seed=0, d=6, d_out=4):
    torch.manual_seed(seed)
    base = nn.Linear(d, d_out, bias=False)
    side = base.weight.detach() + torch.randn(d_out, d)
    return base, side


def test_a_sequence_below_the_threshold_gets_exactly_the_main_output_and_one_above_the_side_output():
    base, side = _router()
    h = torch.randn(2, 3, 6)
    h[1] *= 4  # a larger input moves the side output further from the main one
    s0, s1 = (_score(base.weight.detach(), side, h[b]) for b in range(2))
    assert s0 < s1
    w = WiseDownProj(base, side, (s0 + s1) / 2, [], [], F.silu)
    with torch.no_grad():
        y = w(h)
    assert w.last_choice.tolist() == [0, 1]
    assert torch.allclose(w.last_side_score, torch.tensor([s0, s1]), rtol=1e-5)
    assert torch.equal(y[0], base(h[0]).detach())
    assert torch.equal(y[1], F.linear(h[1], side))
    w.side_threshold = s1 * 1.01  # both below: the main output everywhere
    with torch.no_grad():
        assert torch.equal(w(h), base(h))


def test_padding_is_left_out_of_a_sequences_score_and_long_calls_take_the_largest_token_score():
    base, side = _router(1)
    h = torch.randn(1, 4, 6)
    h[0, :2] *= 50  # two padded positions with huge inputs
    real = _score(base.weight.detach(), side, h[0, 2:])
    w = WiseDownProj(base, side, real * 1.01, [], [], F.silu)
    w.attention_mask = torch.tensor([[0, 0, 1, 1]])
    with torch.no_grad():
        w(h)
    assert w.last_choice.tolist() == [0] and float(w.last_side_score[0]) == pytest.approx(real, rel=1e-5)
    # incremental decoding: the mask covers the past too, the current token is its last column
    w.attention_mask = torch.tensor([[0, 0, 1, 1, 1]])
    with torch.no_grad():
        w(h[:, -1:])
    assert float(w.last_side_score[0]) == pytest.approx(_score(base.weight.detach(), side, h[0, -1:]), rel=1e-5)
    long = torch.randn(1, 101, 6)
    per_token = [_score(base.weight.detach(), side, long[0, t : t + 1]) for t in range(101)]
    w.attention_mask = None
    with torch.no_grad():
        w(long)
    assert float(w.last_side_score[0]) == pytest.approx(max(per_token), rel=1e-5)


def test_a_saved_memory_answers_when_it_beats_its_threshold_and_the_side_score():
    base, side = _router(2)
    W = base.weight.detach()
    memory = W + 3 * torch.randn_like(W)
    h = torch.randn(1, 3, 6)
    s_side, s_mem = _score(W, side, h[0]), _score(W, memory, h[0])
    lo, hi = sorted([s_side, s_mem])
    cases = [  # (side threshold, memory threshold) -> choice
        (hi * 2, lo / 2, 2 if s_mem > s_side else 0),  # the memory beats the side score only if larger
        (hi * 2, hi * 2, 0),  # neither passes its threshold
        (lo / 2, hi * 2, 1),  # only the side memory passes
    ]
    for t_side, t_mem, expected in cases:
        w = WiseDownProj(base, side, t_side, [memory], [t_mem], F.silu)
        with torch.no_grad():
            y = w(h)
        assert w.last_choice.tolist() == [expected]
        want = [base(h), F.linear(h, side), F.linear(h, memory)][expected]
        assert torch.equal(y, want.detach())


def test_ties_merge_against_a_hand_computed_example():
    base = torch.ones(6)
    t1 = base + torch.tensor([3.0, -1.0, 2.0, 0.5, 2.0, 1.0])
    t2 = base + torch.tensor([-1.0, -2.0, 4.0, 0.0, -3.0, 0.0])
    # density 0.5 keeps 3 of 6 per task vector: t1 -> [3, 0, 2, 0, 2, 0]; t2 -> [0, -2, 4, 0, -3, 0]
    # weighted 0.5 each, summed: [1.5, -1, 3, 0, -0.5, 0]; elected signs [+, -, +, +, -, +]
    # agreeing entries: t1 at 0, 2; t2 at 1, 2, 4; merged = their mean, 0 where none agrees
    got = ties_merge(base, [t1, t2], [0.5, 0.5], density=0.5)
    assert torch.allclose(got, base + torch.tensor([3.0, -2.0, 3.0, 0.0, -3.0, 0.0]))
    # unequal weights, no trimming: weighted [0.75, -0.25, 0.5, 0.125, 0.5, 0.25] and [-0.75, -1.5, 3, 0, -2.25, 0],
    # summed [0, -1.75, 3.5, 0.125, -1.75, 0.25] (a zero sum elects +); the agreeing entries' weighted mean
    got = ties_merge(base, [t1, t2], [0.25, 0.75], density=1.0)
    assert torch.allclose(got, base + torch.tensor([3.0, -1.75, 3.5, 0.5, -3.0, 1.0]))


def test_the_margins_against_a_hand_computed_example():
    m = Margins(alpha=5.0, beta=20.0, gamma=10.0)
    # gap: 8 - [25, 15] + 10 = [-7, 3] -> 3; unrelated: 8 - 5 -> 3; in-scope: 20 - [25, 15] = [-5, 5] -> 5
    assert float(margin_loss(torch.tensor([25.0, 15.0]), torch.tensor([8.0]), m)) == pytest.approx(11.0)
    assert float(margin_loss(torch.tensor([40.0, 30.0]), torch.tensor([1.0]), m)) == 0.0


def test_shards_are_saved_and_merged_with_their_smallest_scores_as_thresholds():
    cfg = types.SimpleNamespace(save_freq=2, merge_freq=4, merge_weight=1.0, density=0.5)
    main = torch.zeros(2, 2)
    state = WiseState(side=main.clone())
    sides = [torch.tensor([[1.0, 2.0], [0.0, -1.0]]), torch.tensor([[-3.0, 1.0], [2.0, 0.5]])]
    scores = [7.0, 5.0, 9.0, 6.0]
    for k, score in enumerate(scores):
        state.side = sides[k // 2].clone()  # what training left in the side memory
        after_edit(state, {"score": score}, main, cfg)
        if k == 1:  # a shard after save_freq edits, a fresh copy of the main weight
            assert len(state.memories) == 1 and state.memory_mins == [5.0]
            assert torch.equal(state.side, main) and state.side_min == float("inf")
    assert len(state.memories) == 1 and state.memory_mins == [5.0]  # the two shards merged into one
    assert torch.equal(state.memories[0], ties_merge(main, sides, [0.5, 0.5], 0.5))
    editor = WiseEditor(0, state, WiseConfig(), "silu", {})
    assert editor.thresholds == (float("inf"), [0.88 * 5.0])


def test_the_target_loss_reads_only_the_target_tokens(tiny):
    model, tok = tiny
    r = tiny_requests()[0]
    b = edit_batch(tok, r.prompt, r.target_new, UNRELATED[0], PREFIXES, "cpu")
    assert b.n_in_scope == len(PREFIXES) and b.input_ids.shape[0] == len(PREFIXES) + 1
    logits = torch.randn(b.input_ids.shape[0], b.input_ids.shape[1], 128)
    want = []
    for row in range(b.n_in_scope):
        ids = b.input_ids[row]
        n = int(b.lengths[row])
        target = ids[-n:]  # left padding: a row's target tokens are its last ones
        assert tok.decode(target.tolist()).strip() == r.target_new
        ce = F.cross_entropy(logits[row, -n - 1 : -1], target, reduction="sum")
        want.append(ce / (n + 1))
    assert float(target_loss(logits, b)) == pytest.approx(float(torch.stack(want).mean()), rel=1e-6)


def test_the_pass_from_the_edited_layer_gives_the_full_pass_logits(tiny):
    model, tok = tiny
    r = tiny_requests()[0]
    b = edit_batch(tok, r.prompt, r.target_new, UNRELATED[0], PREFIXES, "cpu")
    up = UpperForward(model, LAYER)
    up.prepare(b.inputs())
    assert up.check(b.keep)
    with torch.no_grad():
        full = model(**b.inputs(), logits_to_keep=b.keep).logits
        assert torch.allclose(up(b.keep, 2), full[:2], atol=1e-5)
    assert not UpperForward(tiny_model("gpt2"), LAYER).enabled


def test_fit_attach_and_detach(tiny):
    """Fitting changes nothing in the model; the threshold is act_ratio times the smallest edit score;
    attach routes through the side memory and detach restores the module, its hooks and its outputs."""
    model, tok = tiny
    reqs = tiny_requests()
    site = locate_down_proj(model, LAYER)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    cfg = WiseConfig(layer=LAYER, n_iter=8)
    ed = fit_wise(model, tok, reqs, cfg, unrelated=UNRELATED, prefixes=PREFIXES)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert locate_down_proj(model, LAYER).module is site.module
    assert ed.thresholds[0] == pytest.approx(0.88 * min(e["score"] for e in ed.state.log))
    assert not torch.equal(ed.state.side, site.weight())
    batch = tok(["Toko Yasuda plays the"], return_tensors="pt")
    with torch.no_grad():
        before = model(**batch).logits.clone()
        ed.attach(model)
        assert isinstance(locate_down_proj(model, LAYER).module, WiseDownProj)
        model(**batch)
        ed.detach(model)
        after = model(**batch).logits
    assert locate_down_proj(model, LAYER).module is site.module
    assert not model._forward_pre_hooks and torch.equal(after, before)


def test_an_interrupted_wise_fit_resumes_with_the_same_numbers(tiny, tmp_path, monkeypatch):
    import aloe_eval.baselines.wise_fit as wise_fit

    model, tok = tiny
    reqs = tiny_requests()
    cfg = WiseConfig(layer=LAYER, n_iter=6, save_freq=2, merge_freq=2)
    kw = dict(unrelated=UNRELATED, prefixes=PREFIXES)
    whole = fit_wise(model, tok, reqs, cfg, **kw)
    real, calls = wise_fit.train_edit, []
    monkeypatch.setattr(wise_fit, "train_edit", stopping_at(3, real, calls))
    with pytest.raises(KeyboardInterrupt):
        fit_wise(model, tok, reqs, cfg, checkpoint_dir=tmp_path, checkpoint_every=1, **kw)
    monkeypatch.setattr(wise_fit, "train_edit", stopping_at(0, real, calls))
    calls.clear()
    resumed = fit_wise(model, tok, reqs, cfg, checkpoint_dir=tmp_path, checkpoint_every=1, **kw)
    assert len(calls) == len(reqs) - 2 and resumed.info()["resumed_edits"] == 2
    assert resumed.info()["peak_memory_mb"] > 0  # the fit records the process peak, as the weight editors do
    assert len(whole.state.memories) == 1  # the first two edits saved and merged as one shard
    assert torch.equal(resumed.state.side, whole.state.side)
    assert all(torch.equal(a, b) for a, b in zip(resumed.state.memories, whole.state.memories))
    assert resumed.state_key() == whole.state_key()


@pytest.mark.parametrize("depth, layer", [(30, 26), (32, 28), (3, 2)])
def test_the_chosen_layer_is_scaled_to_the_depth(depth, layer):
    assert wise_layer(tiny_model("llama", num_layers=depth)) == layer
