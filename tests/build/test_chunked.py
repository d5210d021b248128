"""Long stage-3 passes in saved chunks: an interrupted stage resumes inside and gets the same result."""

from __future__ import annotations

import random

import pytest
import torch
from test_pipeline import _edits, _tiny_cfg
from tiny_models import tiny_model, tiny_tokenizer

import aloe_build.chunked as chunked
from aloe_build.checkpoints import PartStore
from aloe_build.corpus import load_corpus
from aloe_build.slots import make_slots
from aloe_build.stages.s3_rollouts import rollouts, token_sequences
from aloe_build.states import collect_states


def test_part_store_reads_back_and_forgets_another_key(tmp_path):
    store = PartStore(tmp_path / "p", "k1")
    calls = []
    first, read = store.cached("a", lambda: calls.append(1) or {"x": torch.arange(3)})
    again, read_again = store.cached("a", lambda: calls.append(1) or {"x": torch.zeros(3)})
    assert not read and read_again and calls == [1]
    assert torch.equal(again["x"], torch.arange(3))
    assert PartStore(tmp_path / "p", "k2").get("a") is None  # another key: the old pieces are gone
    assert PartStore(None, "k").get("a") is None


def test_chunked_states_equal_one_pass(tmp_path, monkeypatch):
    model, tok = tiny_model("llama"), tiny_tokenizer()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in torch.randint(1, 9, (11,), generator=g)]
    positions = [list(range(0, len(s), 2)) for s in seqs]
    positions[3] = []  # a sequence with no position kept
    monkeypatch.setattr(chunked, "CHUNK_SEQUENCES", 4)
    got = chunked.chunked_states(PartStore(tmp_path, "k"), "x", model, tok, seqs, 1, positions, "test", 5, 2)
    want = collect_states(model, tok, seqs, 1, positions, 3)
    assert torch.equal(got.offsets, want.offsets)
    torch.testing.assert_close(got.states, want.states, rtol=1e-5, atol=1e-6)
    assert sorted(p.name for p in tmp_path.glob("x-*.safetensors")) == [
        "x-sorted-of4-0.safetensors",
        "x-sorted-of4-1.safetensors",
        "x-sorted-of4-2.safetensors",
    ]


def test_interrupted_rollouts_resume_inside_the_stage(tmp_path, monkeypatch):
    """Stage 3 interrupted in its sixth chunk: the five saved chunks are read back, the rest is
    computed, and every tensor equals an uninterrupted run's."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    cfg = _tiny_cfg(tmp_path)
    corpus, _ = load_corpus(cfg.encoder_corpus, cfg.encoder_records, cfg.encoder_same_subject, cfg.seed)
    slots = make_slots(_edits())
    seqs = token_sequences(tok, slots, corpus, cfg)
    monkeypatch.setattr(chunked, "CHUNK_SEQUENCES", 2)
    calls, stop_at = [], []
    real = chunked.collect_states_tree

    def counted(*args, **kwargs):
        calls.append(len(args[2]))
        if len(calls) == (stop_at[0] if stop_at else -1):
            raise KeyboardInterrupt  # this chunk never finishes
        return real(*args, **kwargs)

    def stage3(parts):
        return rollouts(model, tok, slots, seqs, corpus, tmp_path / "enc", 1, cfg, random.Random(0), parts)[0]

    monkeypatch.setattr(chunked, "collect_states_tree", counted)
    whole = stage3(None)
    uninterrupted = len(calls)
    assert uninterrupted > 6
    calls.clear()
    stop_at.append(6)
    with pytest.raises(KeyboardInterrupt):
        stage3(PartStore(tmp_path / "parts", "k"))
    saved = [p for p in (tmp_path / "parts").glob("*.safetensors") if not p.name.startswith(("predicted", "cont"))]
    assert len(saved) == 5
    calls.clear()
    stop_at.clear()
    resumed = stage3(PartStore(tmp_path / "parts", "k"))
    assert len(calls) == uninterrupted - 5  # the five saved chunks were read back, not recomputed
    assert whole.keys() == resumed.keys()
    for name in whole:
        assert torch.equal(whole[name], resumed[name]), name


class _RecordingBar:
    """A stand-in for tqdm that records its start and every update."""

    made: list["_RecordingBar"] = []

    def __init__(self, total, initial=0, **_):
        self.total, self.initial, self.updates = total, initial, []
        _RecordingBar.made.append(self)

    def update(self, k):
        self.updates.append(k)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_chunked_states_run_trees_of_the_size_asked(tmp_path, monkeypatch):
    """Each chunk is collected in trees of ``pack_tokens`` nodes, ``trees_per_pass`` per pass, and
    the states stay those of one plain pass."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (19,), generator=g)]
    asked = []
    real = chunked.collect_states_tree

    def recording(*args, **kwargs):
        asked.append(args[5:7])
        return real(*args, **kwargs)

    monkeypatch.setattr(chunked, "collect_states_tree", recording)
    got = chunked.chunked_states(None, "x", model, tok, seqs, 1, None, "test", 6, 3)
    assert asked == [(6, 3)]
    torch.testing.assert_close(got.states, collect_states(model, tok, seqs, 1, None, 3).states, rtol=1e-5, atol=1e-6)


def test_the_bar_advances_after_every_batch_and_starts_at_what_was_saved(tmp_path, monkeypatch):
    """Chunks of 8 sequences, 3 per pass (a tree each): the bar moves pass by pass (not once per
    chunk), its updates add up to the sequences computed, and a resumed pass starts it at the saved ones."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in torch.randint(2, 9, (19,), generator=g)]
    monkeypatch.setattr(chunked, "CHUNK_SEQUENCES", 8)
    monkeypatch.setattr(chunked, "tqdm", _RecordingBar)
    _RecordingBar.made.clear()
    chunked.chunked_states(PartStore(tmp_path, "k"), "x", model, tok, seqs, 1, None, "test", 1, 3)
    bar = _RecordingBar.made[-1]
    assert bar.initial == 0 and sum(bar.updates) == 19
    assert len([k for k in bar.updates if k > 0]) >= 7  # at least ceil(8/3) + ceil(8/3) + ceil(3/3) batches
    assert max(bar.updates) <= 3
    (tmp_path / "x-sorted-of8-2.safetensors").unlink()  # the last chunk (3 sequences) is lost
    chunked.chunked_states(PartStore(tmp_path, "k"), "x", model, tok, seqs, 1, None, "test", 1, 3)
    bar = _RecordingBar.made[-1]
    assert bar.initial == 16 and sum(bar.updates) == 3


def test_chunked_tokens_and_states_resume_with_the_same_tokens_and_states(tmp_path, monkeypatch):
    """Continuations with their states in saved chunks: a lost chunk is computed again, the others
    are read back, and tokens and states equal one uninterrupted call's."""
    from aloe_build.stages.s3_rollouts import continued

    model, tok = tiny_model("llama"), tiny_tokenizer()
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(5, 60, (int(n),), generator=g).tolist() for n in torch.randint(1, 7, (7,), generator=g)]
    starts = [0, 1, len(prompts[2]), 0, 0, 1, 0]
    monkeypatch.setattr(chunked, "CHUNK_SEQUENCES", 3)
    whole, states = continued(model, tok, prompts, 4, 1, 2, "test", starts=starts)
    parts = PartStore(tmp_path, "k")
    continued(model, tok, prompts, 4, 1, 2, "test", parts, "c", starts=starts)
    assert sorted(p.name for p in tmp_path.glob("c-*")) == [f"c-with-states-of3-{k}.safetensors" for k in range(3)]
    (tmp_path / "c-with-states-of3-1.safetensors").unlink()
    again, states_again = continued(model, tok, prompts, 4, 1, 2, "test", parts, "c", starts=starts)
    assert again == whole
    assert torch.equal(states_again.offsets, states.offsets)
    assert torch.equal(states_again.states, states.states)
    assert states.offsets.diff().tolist() == [len(c) - s for c, s in zip(whole, starts)]
