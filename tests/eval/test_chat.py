"""Requests asked through the chat template: prompts, answers and the chat metrics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from aloe_build.data import EditRequest
from aloe_build.tokens import chat_answer, chat_prompt, stop_ids
from aloe_eval import Editor
from aloe_eval.chat import CHAT_TOKENS, chat_evaluation
from aloe_eval.metrics import contains_target, starts_with_target
from tests.helpers import stopping_at
from tests.tiny_models import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer


class ForceToken(Editor):
    """Adds a large logit to one token at every position while attached (answers change from the first token)."""

    name = "force"

    def __init__(self, token: int):
        self.token, self.handle = token, None

    def attach(self, model):
        def hook(module, args, out):
            out = out.clone()
            out[..., self.token] += 1e4
            return out

        self.handle = model.lm_head.register_forward_hook(hook)

    def detach(self, model):
        self.handle.remove()


def _setup():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    return model, tok


def _answer(model, tok, question: str, system: str | None) -> list[int]:
    """Greedy answer of one conversation, one at a time with HF generate (no batching, no padding)."""
    ids = torch.tensor([chat_prompt(tok, question, system)])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=CHAT_TOKENS,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=None,
        )
    return out[0, ids.shape[1] :].tolist()


def test_target_rules():
    assert contains_target("It is in Rome, Italy", " rome ") and not contains_target("Paris", "Rome")
    assert starts_with_target("  Rome, of course", "rome") and not starts_with_target("In Rome", "Rome")


def test_chat_prompt_renders_the_template_and_answers_start_without_a_space():
    _, tok = _setup()
    ids = chat_prompt(tok, "the capital of France is", "be brief")
    assert tok.decode(ids) == tok.decode(
        tok("system : be brief . user : the capital of France is . assistant :", add_special_tokens=False)["input_ids"]
    )
    assert chat_answer(tok, " Paris ") == tok("Paris", add_special_tokens=False)["input_ids"]
    two = chat_prompt(tok, ["Rome is in Italy .", "the capital of France is"], None)  # consecutive user turns
    assert tok.decode(two) == tok.decode(
        tok("user : Rome is in Italy . . user : the capital of France is . assistant :", add_special_tokens=False)["input_ids"]
    )
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt(tok, "x")


def test_chat_metrics_against_one_at_a_time_generation():
    """Targets taken from the unedited model's own one-at-a-time answers: the unedited editor scores
    efficacy 1 and locality 1; an editor that forces another first token scores locality 0 and
    efficacy only where the forced token is the target."""
    model, tok = _setup()
    questions = ["The capital of France is", "John Lennon plays the", "The Eiffel Tower is located in the city of"]
    answers = [tok.decode(_answer(model, tok, q, None), skip_special_tokens=True) for q in questions]
    first = [a.split()[0] for a in answers]
    forced = next(t for t in range(3, 128) if tok.decode([t]).isalpha() and not any(tok.decode([t]) in a for a in answers))
    reqs = [
        EditRequest(q, first[i] if i else tok.decode([forced]), "x", locality=[questions[(i + 1) % 3]], id=str(i))
        for i, q in enumerate(questions)
    ]
    systems = {"default_system": None}

    class Unedited(Editor):
        def attach(self, model):
            pass

        def detach(self, model):
            pass

    same = chat_evaluation(model, tok, reqs, Unedited(), batch_size=2, progress=False, systems=systems)["default_system"]
    assert same["locality"] == 1.0
    assert same["efficacy"] == same["unedited_efficacy"] == pytest.approx(2 / 3)  # edit 0's target is forced's
    forced_run = chat_evaluation(model, tok, reqs, ForceToken(forced), batch_size=2, progress=False, systems=systems)[
        "default_system"
    ]
    assert forced_run["locality"] == 0.0
    assert forced_run["efficacy"] == forced_run["efficacy_prefix"] == pytest.approx(1 / 3)
    assert [m["request"] for m in forced_run["misses"]] == questions[1:]
    # after the edit's statement in a turn of its own: the unedited editor changes nothing, the forced
    # token changes every answer, and only edit 0's answers (its target is the forced token) leak
    assert same["distracted_locality"] == 1.0 and same["distracted_leak"] == 0.0
    statement0 = f"{questions[0]} {tok.decode([forced])}."
    unedited0 = tok.decode(_answer(model, tok, (statement0, questions[1]), None), skip_special_tokens=True)
    assert tok.decode([forced]) not in unedited0
    assert forced_run["distracted_locality"] == 0.0
    assert forced_run["distracted_leak"] == pytest.approx(1 / 3)
    # the request after an unrelated sentence: the forced token is edit 0's target only; the unedited
    # answers are those of one-at-a-time generation on the same user turns
    in_ctx = ["Please answer the following question. " + questions[0], "The weather was cold that winter. " + questions[1]]
    in_ctx.append("He said nothing more about it. " + questions[2])
    base = [tok.decode(_answer(model, tok, q, None), skip_special_tokens=True) for q in in_ctx]
    want = sum(r.target_new.lower() in b.lower() for r, b in zip(reqs, base)) / 3
    assert same["in_context_efficacy"] == same["unedited_in_context_efficacy"] == pytest.approx(want)
    assert forced_run["in_context_efficacy"] == pytest.approx(1 / 3)


@pytest.mark.slow
def test_chat_gates_split_misses_into_address_and_write():
    """An operator whose slot 0 opens exactly on request 0's chat prompt (its last token) and whose
    other slots stay shut, with zero writes: the answers are the unedited ones, so request 1 (target
    = its own answer's first word) hits and requests 0 and 2 miss, 0 with its gate open (a write
    miss) and 2 with it shut (an address miss)."""
    from aloe_eval.editors import AloeEditor
    from aloe_kernels import AloeOperator
    from aloe_kernels.hf import locate_down_proj
    from tests.helpers import operator_opening_on

    model, tok = _setup()
    questions = ["The capital of France is", "John Lennon plays the", "The Eiffel Tower is located in the city of"]
    site = locate_down_proj(model, 1)
    box = {}
    handle = site.module.register_forward_pre_hook(lambda m, a: box.__setitem__("h", a[0].detach()))
    with torch.no_grad():
        model(input_ids=torch.tensor([chat_prompt(tok, questions[0], None)]))
    handle.remove()
    op = operator_opening_on(box["h"][0, -1:], n_extra=2, d_out=site.d_out)
    op = AloeOperator(
        addresses=op.addresses,
        thresholds=op.thresholds,
        temperatures=op.temperatures,
        writes=torch.zeros_like(op.writes),
        layer=1,
        weight_fingerprint="unchecked",
        edits=[{"id": str(i)} for i in range(3)],
    )
    first_word = tok.decode(_answer(model, tok, questions[1], None), skip_special_tokens=True).split()[0]
    reqs = [EditRequest(q, t, "x", id=str(i)) for i, (q, t) in enumerate(zip(questions, ["zzz", first_word, "zzz"]))]
    got = chat_evaluation(
        model, tok, reqs, AloeEditor(op, check_fingerprint=False), batch_size=2, progress=False, systems={"default_system": None}
    )["default_system"]
    assert got["efficacy"] == pytest.approx(1 / 3)
    g = got["gates"]
    assert g["mapped"] == 3 and g["open_share"] == pytest.approx(1 / 3)
    assert g["misses"] == {"address": 1, "write": 1}
    assert 0.5 <= g["own_gate_mean"] * 3 <= 1.0  # slot 0's gate, the others exactly 0


def test_changed_locality_gates_locate_the_gate_that_changed_an_answer():
    """Three changed answers: one changed where slot 0 opens (its own edit's slot, the chat prompt's
    last token), one where no gate opens (a plain prompt), one after the answer's second token, where slot 1 opens
    (another edit's slot). Counted as a float64 gate computation over one-at-a-time forwards says."""
    from aloe_eval.chat import changed_locality_gates
    from aloe_eval.editors import AloeEditor
    from aloe_kernels import AloeOperator
    from aloe_kernels.hf import locate_down_proj
    from aloe_kernels.reference import gates_from_scores
    from tests.helpers import operator_opening_on

    model, tok = _setup()
    site = locate_down_proj(model, 1)
    box = {}
    handle = site.module.register_forward_pre_hook(lambda m, a: box.__setitem__("h", a[0].detach()))

    def states(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        return box["h"][0]

    # b is asked without the template: the tiny model's states at the template's last tokens are alike
    a, b = chat_prompt(tok, "The capital of France is", None), tok("The Eiffel Tower is located in")["input_ids"]
    answer = [40, 41, 42]
    h_a = states(a + answer[:2])
    op = operator_opening_on(torch.stack([h_a[len(a) - 1], h_a[len(a) + 1]]), n_extra=1, d_out=site.d_out)
    tau = op.thresholds.clone()
    tau[1] = 0.85  # slot 1's own gate differs from slot 0's: no tie at the maximum
    op = AloeOperator(
        addresses=op.addresses,
        thresholds=tau,
        temperatures=op.temperatures,
        writes=op.writes,
        layer=1,
        weight_fingerprint="unchecked",
    )
    prompts = [a, b, a]
    unedited = [answer, answer, answer]
    edited = [[43], [43, 41], answer[:2] + [43]]
    owners = [0, 1, 0]
    got = changed_locality_gates(
        model, tok, AloeEditor(op, check_fingerprint=False), prompts, unedited, edited, [(s,) for s in owners], batch_size=2
    )
    handle = site.module.register_forward_pre_hook(lambda m, a: box.__setitem__("h", a[0].detach()))
    want = {"changed": 3, "open": 0, "small": 0, "closed": 0, "own_slot": 0, "other_slot": 0, "in_prompt": 0, "in_answer": 0}
    V, t, al = (x.double() for x in (op.addresses, op.thresholds, op.temperatures))
    for p, cut, own in zip(prompts, [0, 0, 2], owners):
        h = torch.nn.functional.normalize(states(p + answer[:cut]).double(), dim=1)
        g = gates_from_scores(h @ V.T, t, al, op.gate_eps)
        best = g.max()
        if best <= 0:
            want["closed"] += 1
            continue
        pos, slot = divmod(int(g.argmax()), g.shape[1])
        want["open" if best >= 0.5 else "small"] += 1
        want["own_slot" if slot == own else "other_slot"] += 1
        want["in_prompt" if pos < len(p) else "in_answer"] += 1
    handle.remove()
    assert got == want
    assert want == {
        "changed": 3,
        "open": 2,
        "small": 0,
        "closed": 1,
        "own_slot": 1,
        "other_slot": 1,
        "in_prompt": 1,
        "in_answer": 1,
    }


def _two_requests() -> list[EditRequest]:
    """Two requests, each the other's locality prompt."""
    questions = ["The capital of France is", "John Lennon plays the"]
    return [EditRequest(q, "Paris", "x", locality=[questions[1 - i]], id=str(i)) for i, q in enumerate(questions)]


def test_chat_answers_are_saved_and_an_interrupted_run_resumes(tmp_path, monkeypatch):
    """With a part store each answer list is saved as it is generated: a run stopped at its third
    list keeps the first two, the rerun generates only the rest and gives the uninterrupted result;
    another editor generates its own answers again but reads the unedited model's, another model
    context generates everything."""
    import aloe_eval.chat as chat
    from aloe_eval.chunks import ChunkStore

    model, tok = _setup()
    reqs = _two_requests()
    run = dict(batch_size=2, progress=False, systems={"default_system": None})
    whole = chat_evaluation(model, tok, reqs, ForceToken(5), **run)

    real, calls = chat.chat_answers, []

    def stops_at_third(*args, **kwargs):
        calls.append(kwargs["desc"])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    store = ChunkStore(tmp_path / "parts")
    monkeypatch.setattr(chat, "chat_answers", stops_at_third)
    with pytest.raises(KeyboardInterrupt):
        chat_evaluation(model, tok, reqs, ForceToken(5), parts=store, context="op-a", **run)
    assert len(list((tmp_path / "parts").glob("chat-*.json.gz"))) == 2

    calls.clear()
    monkeypatch.setattr(chat, "chat_answers", lambda *a, **k: calls.append(k["desc"]) or real(*a, **k))
    resumed = chat_evaluation(model, tok, reqs, ForceToken(5), parts=store, context="op-a", **run)
    edited = [
        f"chat (default_system): edited {x}" for x in ("requests", "locality", "distracted locality", "in-context requests")
    ]
    unedited = [f"chat (default_system): unedited {x}" for x in ("distracted locality", "in-context requests")]
    assert calls == [*unedited, *edited]
    assert resumed == whole

    calls.clear()
    other_editor = chat_evaluation(model, tok, reqs, ForceToken(6), parts=store, context="op-b", **run)
    assert calls == edited
    assert other_editor == chat_evaluation(model, tok, reqs, ForceToken(6), **run)

    calls.clear()
    chat_evaluation(model, tok, reqs, ForceToken(5), parts=store, context="op-a", model_context="other", **run)
    assert len(calls) == 8  # requests, locality, distracted locality and in-context requests, unedited and edited


def test_unedited_chat_answers_are_read_from_a_shared_store(tmp_path, monkeypatch):
    """The unedited answers go to ``unedited_parts`` (a cache shared by evaluations): a second
    evaluation with an empty part store of its own generates only the edited answers and gives the
    result of an evaluation without any store."""
    import aloe_eval.chat as chat
    from aloe_eval.chunks import ChunkStore

    model, tok = _setup()
    reqs = _two_requests()
    run = dict(
        batch_size=2,
        progress=False,
        systems={"default_system": None},
        model_context="m",
        unedited_parts=ChunkStore(tmp_path / "cache"),
    )
    chat_evaluation(model, tok, reqs, ForceToken(5), parts=ChunkStore(tmp_path / "a"), context="op-a", **run)
    assert len(list((tmp_path / "cache").glob("chat-unedited-*.json.gz"))) == 4
    assert not list((tmp_path / "a").glob("chat-unedited-*"))

    real, calls = chat.chat_answers, []
    monkeypatch.setattr(chat, "chat_answers", lambda *a, **k: calls.append(k["desc"]) or real(*a, **k))
    got = chat_evaluation(model, tok, reqs, ForceToken(7), parts=ChunkStore(tmp_path / "b"), context="op-b", **run)
    edited = ("requests", "locality", "distracted locality", "in-context requests")
    assert calls == [f"chat (default_system): edited {x}" for x in edited]
    monkeypatch.setattr(chat, "chat_answers", real)
    assert got == chat_evaluation(model, tok, reqs, ForceToken(7), batch_size=2, progress=False, systems={"default_system": None})


def test_a_long_answer_list_is_saved_in_blocks_and_resumes_within_the_list(tmp_path, monkeypatch):
    """Questions of ragged lengths in blocks of one batch of 2: the answers are each question's own
    one-at-a-time answer, a run stopped at its third block keeps two blocks, the rerun generates
    only the rest, and once the list is whole only its one file remains."""
    import aloe_eval.chat as chat
    from aloe_eval.chunks import ChunkStore

    model, tok = _setup()
    questions = [
        "The capital of France is",
        "John Lennon plays the",
        "The Eiffel Tower is located in the city of",
        "Water is",
        "The largest planet of the solar system, after the Sun, is called",
        "Paris is in",
        "Berlin",
    ]
    monkeypatch.setattr(chat, "ANSWER_BLOCK_BATCHES", 1)
    real, calls = chat.chat_answers, []
    store = ChunkStore(tmp_path / "parts")
    run = dict(store=store, file="chat-x", key="k", batch_size=2)
    monkeypatch.setattr(chat, "chat_answers", stopping_at(3, real, calls))
    with pytest.raises(KeyboardInterrupt):
        chat.saved_chat_answers(model, tok, questions, None, **run)
    assert len(list((tmp_path / "parts").glob("chat-x-block*.json.gz"))) == 2

    calls.clear()
    monkeypatch.setattr(chat, "chat_answers", stopping_at(0, real, calls))
    got = chat.saved_chat_answers(model, tok, questions, None, **run)
    assert [len(args[2]) for args in calls] == [2, 1]  # the third block of two questions and the last of one
    stops = set(stop_ids(tok))
    for q, answer in zip(questions, got):
        alone = _answer(model, tok, q, None)
        cut = next((k + 1 for k, t in enumerate(alone) if t in stops), len(alone))
        assert answer == alone[:cut], q
    assert [f.name for f in (tmp_path / "parts").iterdir()] == ["chat-x.json.gz"]
    calls.clear()
    assert chat.saved_chat_answers(model, tok, questions, None, **run) == got and calls == []


def test_an_aloe_editors_state_key_follows_its_operator_and_how_it_is_patched_in():
    """The key that ALOE's saved chat answers are read back under: the same operator patched in the
    same way gives the same key (a new editor object included), and a changed write, write positions
    or precision gives another, so stale answers are never read back."""
    from aloe_eval.editors import AloeEditor
    from tests.helpers import operator_opening_on

    op = operator_opening_on(torch.randn(2, 8, generator=torch.Generator().manual_seed(1)), n_extra=1, d_out=5)
    first = AloeEditor(op, check_fingerprint=False, layer=1)
    assert first.state_key() == AloeEditor(op, check_fingerprint=False, layer=1).state_key()
    writes = op.writes.clone()
    writes[0, 0] += 1.0
    moved = AloeEditor(dataclasses.replace(op, writes=writes), check_fingerprint=False, layer=1)
    assert moved.state_key() != first.state_key()
    assert AloeEditor(op, check_fingerprint=False, layer=1, write_positions="all").state_key() != first.state_key()
    assert AloeEditor(op, check_fingerprint=False, layer=1, dtype=torch.bfloat16).state_key() != first.state_key()
