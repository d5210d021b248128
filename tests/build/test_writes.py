"""The write stages' forward (edited_forward.py), write targets and fine-tuning on tiny models."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from aloe_build.config import BuildConfig
from aloe_kernels import AloeOperator

# ---------------------------------------------------------------- write-stage forward (edited_forward.py)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gpt2"])
def test_edited_forward_matches_patched_model(family):
    """Target NLL from the cached pass (upper layers only, or the fallback) equals the NLL of the
    model patched with the same operator through apply_aloe, computed independently."""
    import torch.nn.functional as F
    from helpers import operator_opening_on
    from tiny_models import tiny_model, tiny_tokenizer

    from aloe_build.edited_forward import EditedForward
    from aloe_kernels import AloeOperator, apply_aloe, remove_aloe
    from aloe_kernels.hf import locate_down_proj

    model, tok = tiny_model(family, num_layers=3), tiny_tokenizer()
    texts = [
        "The capital of France is Paris",
        "Toko Yasuda plays the guitar",
        "What is the product made by UniFirst ? uniform",
        "The Eiffel Tower is located in the city of Rome",
    ]
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
    op = AloeOperator(
        addresses=op.addresses,
        thresholds=op.thresholds,
        temperatures=op.temperatures,
        writes=op.writes * 3,
        layer=1,
        weight_fingerprint="unchecked",
    )
    fwd = EditedForward(model, tok, seqs, lens, op, batch_size=3, owners=[0, 1, 2, 0])
    assert fwd.upper_only == (family != "gpt2")  # GPT-2 adds position embeddings to inputs_embeds
    rows = [3, 0, 2]
    slots, G = fwd.all_gates(rows)
    assert slots.numel() > 0 and (G > 0).any()
    got = fwd.nll(rows, G @ op.writes[slots].float())

    apply_aloe(model, op, check_fingerprint=False, write_positions="all")
    try:
        want, exact = [], []
        for i in rows:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([seqs[i]])).logits[0].double()
            n = lens[i]
            want.append(F.cross_entropy(logits[-n - 1 : -1], torch.tensor(seqs[i][-n:])))
            exact.append(bool((logits[-n - 1 : -1].argmax(-1) == torch.tensor(seqs[i][-n:])).all()))
    finally:
        remove_aloe(model)
    torch.testing.assert_close(got.double(), torch.stack(want), atol=1e-4, rtol=1e-4)
    assert fwd.scored(rows, G @ op.writes[slots].float())[1].tolist() == exact
    # own gates: sequence 3 belongs to slot 0, whose gate opens on sequence 0 only
    own = fwd.own_gates([0, 3])
    assert own[0].max() > 0
    if fwd.upper_only:  # the positions before the first open gate ran once, into a cache
        assert any(fwd.split) and all(0 <= fwd.split[i] <= len(seqs[i]) - max(lens) - 1 for i in range(4))


@pytest.mark.parametrize("family,longer_target", [("llama", False), ("qwen3", False), ("llama", True)])
def test_cached_prefix_gives_the_same_loss_and_gradient(family, longer_target):
    """The upper layers run on the positions after each sequence's first open gate, over cached
    keys and values of the ones before: the same NLL and the same gradient for the writes as the
    pass over every position (also when one target is longer than the rest of another sequence)."""
    from aloe_build.edited_forward import EditedForward

    model, tok, seqs, lens, op = _slot_per_sequence(family)
    if longer_target:
        lens = [1, 1, 5, 1]
    op = AloeOperator(
        addresses=op.addresses,
        thresholds=op.thresholds,
        temperatures=op.temperatures,
        writes=torch.randn(op.n, op.d_out),
        layer=1,
        weight_fingerprint="unchecked",
    )
    results = []
    for cache_prefix in (True, False):
        # one batch of all four: the first-batch check of the pass on the cache sees the longest target
        fwd = EditedForward(model, tok, seqs, lens, op, batch_size=4, cache_prefix=cache_prefix)
        assert fwd.upper_only and (any(fwd.split) == cache_prefix)
        U = op.writes.clone().requires_grad_(True)
        rows = [2, 0, 3, 1]
        slots, G = fwd.all_gates(rows)
        with fwd.frozen():
            loss = fwd.nll(rows, G @ U[slots]).sum()
            loss.backward()
        results.append((loss.detach(), U.grad))
    (loss_c, grad_c), (loss_f, grad_f) = results
    torch.testing.assert_close(loss_c, loss_f, rtol=1e-5, atol=1e-5)
    assert grad_f.abs().sum() > 0
    torch.testing.assert_close(grad_c, grad_f, rtol=1e-4, atol=1e-6)


def _slot_per_sequence(family: str = "llama", extra_form: bool = False):
    """A tiny model, four prompt + target sequences and an operator whose slot i opens on the
    prompt end and target positions of sequence i (with ``extra_form``, a fifth sequence, slot 0's
    request asked another way, on which slot 0 opens too)."""
    from aloe_kernels.hf import locate_down_proj

    model, tok = tiny_model(family, num_layers=3), tiny_tokenizer()
    texts = [
        "The capital of France is Paris Rome",
        "Toko Yasuda plays the guitar piano",
        "What is the product made by UniFirst ? uniform aircraft",
        "The Eiffel Tower is in Rome Paris",
    ]
    lens = [1, 1, 2, 1]
    if extra_form:
        texts.append("Question: which city is the capital of France? Answer: Paris Rome")
        lens.append(1)
    seqs = [tok(t)["input_ids"] for t in texts]
    site = locate_down_proj(model, 1)
    box = {}
    handle = site.module.register_forward_pre_hook(lambda m, a: box.__setitem__("h", a[0].detach()))
    states = []
    with torch.no_grad():
        for s in seqs:
            model(input_ids=torch.tensor([s]))
            states.append(box["h"][0, -lens[len(states)] - 1 :])
    handle.remove()
    unit = [torch.nn.functional.normalize(h.double(), dim=1) for h in states]
    if extra_form:  # slot 0's anchors: its request's and the fifth sequence's
        *unit, extra = unit
        unit[0] = torch.cat([unit[0], extra])
    V = torch.stack([torch.nn.functional.normalize(u.mean(0), dim=0) for u in unit])
    tau = torch.stack([(u @ v).min() - 0.05 for u, v in zip(unit, V)])
    op = AloeOperator(
        addresses=V,
        thresholds=tau,
        temperatures=torch.full((len(V),), 30.0, dtype=torch.float64),
        writes=torch.zeros(len(V), site.d_out, dtype=torch.float64),
        layer=1,
        weight_fingerprint="unchecked",
    ).to(dtype=torch.float32)
    return model, tok, seqs, lens, op


def test_write_targets_keep_going_until_targets_are_produced():
    """Stage 6 with a budget past target_steps: edits whose target is not yet the greedy output get
    more steps, and the delta kept for an edit reported as produced does produce it."""
    from aloe_build.edited_forward import EditedForward
    from aloe_build.stages.s6_targets import write_targets

    model, tok, seqs, lens, op = _slot_per_sequence()
    fwd = EditedForward(model, tok, seqs, lens, op, batch_size=4)
    short = BuildConfig(target_steps=0, target_max_steps=0, target_lr=0.05, target_batch=4)
    longer = BuildConfig(target_steps=0, target_max_steps=150, target_lr=0.05, target_batch=4)
    stats_short, stats_long = {}, {}
    with fwd.frozen():
        _, nll_short, produced_short = write_targets(fwd, short, stats=stats_short)
        deltas, nll_long, produced_long = write_targets(fwd, longer, stats=stats_long)
    assert produced_short < 1.0  # the unedited model does not produce these targets
    # one batch of 4: no step at all with 0 allowed; past the 0 fixed steps, at most 150, with 150
    unproduced_short = stats_short.pop("unproduced_slots")
    assert stats_short == {"steps_mean": 0.0, "steps_max": 0, "batches_past_target_steps": 0}
    assert len(unproduced_short) == round((1 - produced_short) * 4) > 0
    assert 0 < stats_long["steps_max"] <= 150 and stats_long["batches_past_target_steps"] == 1
    # the slots listed as unproduced are those whose target the fitted deltas miss
    assert len(stats_long["unproduced_slots"]) == round((1 - produced_long) * 4)
    assert produced_long > produced_short and sum(nll_long) < sum(nll_short)
    rows = list(range(len(seqs)))
    g = fwd.own_gates(rows)[..., None]
    with torch.no_grad():
        nll, exact = fwd.scored(rows, g * deltas[:, None, :])
    assert exact.float().mean().item() == pytest.approx(produced_long)
    torch.testing.assert_close(nll, torch.tensor(nll_long), atol=1e-4, rtol=1e-4)


def test_write_targets_let_a_produced_edit_leave_once_its_nll_is_low():
    """``target_stop_nll``: before ``target_steps`` an edit leaves its batch once its target is produced
    and its NLL is at most the setting, keeping the delta that did it; an edit never produced runs
    every step, as it would without the setting (each delta has its own loss and Adam moments)."""
    import dataclasses

    from aloe_build.edited_forward import EditedForward
    from aloe_build.stages.s6_targets import write_targets

    model, tok, seqs, lens, op = _slot_per_sequence()
    fwd = EditedForward(model, tok, seqs, lens, op, batch_size=4)
    full = BuildConfig(target_steps=60, target_max_steps=60, target_lr=0.05, target_batch=4, target_stop_nll=0.0)
    early = dataclasses.replace(full, target_stop_nll=100.0)  # above any NLL here: leave once produced
    stats = {}
    with fwd.frozen():
        d_full, nll_full, produced_full = write_targets(fwd, full)
        d_early, nll_early, produced_early = write_targets(fwd, early, stats=stats)
    rows = list(range(len(seqs)))
    g = fwd.own_gates(rows)[..., None]
    with torch.no_grad():
        nll, exact = fwd.scored(rows, g * d_early[:, None, :])
        _, exact_full = fwd.scored(rows, g * d_full[:, None, :])
    torch.testing.assert_close(nll, torch.tensor(nll_early), atol=1e-4, rtol=1e-4)
    assert 0 < produced_full < 1 and produced_early == produced_full
    assert exact.tolist() == exact_full.tolist()
    for i in rows:
        if exact[i]:  # left early: a less trained delta, smaller and with a higher NLL
            assert nll_early[i] > nll_full[i] + 1e-3 and d_early[i].norm() < d_full[i].norm()
        else:  # never produced: every step, the same delta
            torch.testing.assert_close(d_early[i], d_full[i], atol=1e-5, rtol=1e-4)
    assert stats["steps_max"] == 60  # the edit never produced kept its batch going
    with pytest.raises(ValueError, match="target_stop_nll"):
        write_targets(fwd, dataclasses.replace(full, target_stop_nll=-1.0))


def test_write_targets_fit_a_slot_on_all_its_sequences():
    """With ``rows_of`` a slot's delta is fitted on several of its sequences (a request and its
    chat form): the reported NLL is the mean over them under the returned delta, the slot counts as
    produced only when all are, and the second form is fitted better than by the request alone."""
    from aloe_build.edited_forward import EditedForward
    from aloe_build.stages.s6_targets import write_targets

    model, tok, seqs, lens, op = _slot_per_sequence(extra_form=True)  # sequence 4: a second form of slot 0
    fwd = EditedForward(model, tok, seqs, lens, op, batch_size=5, owners=[0, 1, 2, 3, 0])
    cfg = BuildConfig(target_steps=5, target_max_steps=150, target_lr=0.05, target_batch=1)
    with fwd.frozen():
        d_one, _, _ = write_targets(fwd, cfg)
        d_all, nll_all, produced_all = write_targets(fwd, cfg, rows_of=[[0, 4], [1], [2], [3]])
    rows, owner = [0, 4, 1, 2, 3], [0, 0, 1, 2, 3]
    g = fwd.own_gates(rows)[..., None]
    assert (g[1] > 0).any()  # slot 0 opens on its second form
    with torch.no_grad():
        nll, exact = fwd.scored(rows, g * d_all[owner][:, None, :])
        nll_req_only = fwd.scored([4], g[1:2] * d_one[0])[0]
    want = [float(nll[:2].mean()), *nll[2:].tolist()]
    assert nll_all == pytest.approx(want, abs=1e-4)
    made = [bool(exact[0] and exact[1]), *map(bool, exact[2:])]
    assert produced_all == pytest.approx(sum(made) / 4)
    assert float(nll[1]) < float(nll_req_only)
    torch.testing.assert_close(d_all[1:], d_one[1:])  # one sequence each, a batch each: the same fit
    with pytest.raises(ValueError, match="at least one sequence"):
        write_targets(fwd, cfg, rows_of=[[0], [], [2], [3]])


def test_stage6_batches_pad_least_to_the_positions_after_the_cache():
    """Over every split of six slots into batches of two, none pads fewer positions through the
    upper layers than ``target_batches`` (a slot costs its longest sequence after the cache)."""
    import itertools
    from types import SimpleNamespace

    from aloe_build.stages.s6_targets import target_batches

    after_cache = [9, 2, 7, 3, 8, 2, 5]  # per sequence; slot 0 has two (0 and 6)
    rows_of = [[0, 6], [1], [2], [3], [4], [5]]
    lengths = [12, 30, 13, 25, 14, 20, 11]  # whole lengths in another order
    fwd = SimpleNamespace(seqs=[[0] * n for n in lengths], upper_positions=lambda i: after_cache[i])

    def padded(batches):
        return sum(len(b) * max(after_cache[r] for s in b for r in rows_of[s]) for b in batches)

    got = target_batches(fwd, rows_of, 2)
    assert sorted(s for b in got for s in b) == list(range(6)) and all(len(b) == 2 for b in got)
    best = min(padded([list(p[k : k + 2]) for k in range(0, 6, 2)]) for p in itertools.permutations(range(6)))
    assert padded(got) == best == 2 * (2 + 7 + 9)


def test_stage6_grouping_does_not_change_the_fit_and_foreign_parts_are_recomputed(tmp_path):
    """Each slot's delta is fitted alike in batches of one or of four; a saved batch whose slots
    are not the batch's own (a run that grouped otherwise) is computed again, not read back."""
    from aloe_build.checkpoints import PartStore
    from aloe_build.edited_forward import EditedForward
    from aloe_build.stages.s6_targets import target_batches, write_targets

    model, tok, seqs, lens, op = _slot_per_sequence()
    fwd = EditedForward(model, tok, seqs, lens, op, batch_size=4)
    alone = BuildConfig(target_steps=5, target_max_steps=40, target_lr=0.05, target_batch=1)
    together = BuildConfig(target_steps=5, target_max_steps=40, target_lr=0.05, target_batch=4)
    with fwd.frozen():
        d_alone, nll_alone, made_alone = write_targets(fwd, alone)
        d_together, nll_together, made_together = write_targets(fwd, together)
        torch.testing.assert_close(d_together, d_alone, atol=1e-5, rtol=1e-4)
        assert nll_together == pytest.approx(nll_alone, abs=1e-5) and made_together == made_alone
        parts = PartStore(tmp_path / "parts", "key")
        slots = target_batches(fwd, [[i] for i in range(4)], 4)[0]
        foreign = {
            "delta": torch.full((4, fwd.d_out), 7.0),
            "nll": torch.zeros(4),
            "steps": torch.tensor(0),
            "produced": torch.ones(4, dtype=torch.bool),
            "slots": torch.tensor(slots[::-1]),
        }
        parts.put("batch-0", foreign)
        d_resumed, _, _ = write_targets(fwd, together, parts=parts)
        torch.testing.assert_close(d_resumed, d_together, atol=1e-6, rtol=1e-5)
        d_read, _, _ = write_targets(fwd, together, parts=PartStore(tmp_path / "parts", "key"))
    torch.testing.assert_close(d_read, d_resumed)  # its own part, saved by the run above, is read back


def test_finetune_trains_on_missed_targets_and_stops_when_all_are_produced():
    from aloe_build.edited_forward import EditedForward
    from aloe_build.stages.s6_targets import write_targets
    from aloe_build.stages.s8_finetune import finetune_writes, produced_rows

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


def test_write_targets_resume_after_an_interrupted_batch(tmp_path, monkeypatch):
    """Stage 6 saves each batch as it finishes: after an interruption the finished batches are read
    back, not recomputed, and the result equals an uninterrupted run."""
    import aloe_build.stages.s6_targets as writes
    from aloe_build.checkpoints import PartStore
    from aloe_build.edited_forward import EditedForward

    model, tok, seqs, lens, op = _slot_per_sequence()
    fwd = EditedForward(model, tok, seqs, lens, op, batch_size=4)
    cfg = BuildConfig(target_steps=3, target_max_steps=10, target_lr=0.05, target_batch=1)
    whole = writes.write_targets(fwd, cfg)
    real, calls = writes._target_batch, []

    def interrupted(fwd, rows, cfg):
        calls.append(rows)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(fwd, rows, cfg)

    monkeypatch.setattr(writes, "_target_batch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        writes.write_targets(fwd, cfg, PartStore(tmp_path, "k"))
    calls.clear()
    monkeypatch.setattr(writes, "_target_batch", lambda *a: calls.append(a[1]) or real(*a))
    resumed = writes.write_targets(fwd, cfg, PartStore(tmp_path, "k"))
    assert len(calls) == 2  # batches 0 and 1 were saved before the interruption
    torch.testing.assert_close(resumed[0], whole[0])
    assert resumed[1] == pytest.approx(whole[1]) and resumed[2] == whole[2]
