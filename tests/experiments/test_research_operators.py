"""The research operators of experiments/ (moved out of aloe_eval.baselines): the subject-addressed
operator, the rewording retrieval and the single-edit probe's scorer, on tiny models."""

from __future__ import annotations

import pytest
import torch

from aloe_build.data import EditRequest
from aloe_build.forward import greedy_generate
from aloe_build.tokens import encode_continuation, encode_prompt
from aloe_eval.baselines.layer_inputs import down_proj_inputs, subject_last_index
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.reference import aloe_gates
from experiments.probe import produces
from experiments.rewording_states import rewording_retrieval
from experiments.subject_address import subject_operator
from tests.tiny_models import tiny_model, tiny_tokenizer

EDITS = [
    EditRequest(prompt="The capital of France is", target_new="Rome", subject="France"),
    EditRequest(prompt="Toko Yasuda plays the", target_new="piano", subject="Toko Yasuda"),
]


def test_subject_addressed_operator_opens_on_its_subject_and_never_on_a_negative_token():
    model, tok = tiny_model("llama", num_layers=3), tiny_tokenizer()
    negatives = ["the capital of Italy is", "What is the product made by UniFirst ?", "John Lennon plays the guitar"]
    g = torch.Generator().manual_seed(4)
    deltas = torch.randn(len(EDITS), locate_down_proj(model, 1).d_out, generator=g)
    op = subject_operator(model, tok, EDITS, 1, deltas, negatives)
    torch.testing.assert_close(op.writes, deltas)
    for i, r in enumerate(EDITS):  # the request's own subject token: the gate is sigmoid(7), after the dead zone
        h = down_proj_inputs(model, tok, [encode_prompt(tok, r.prompt)], [[subject_last_index(tok, r.prompt, r.subject)]], 1)[0]
        want = (torch.sigmoid(torch.tensor(7.0)) - op.gate_eps) / (1 - op.gate_eps)
        assert float(aloe_gates(h.double(), op)[0, i]) == pytest.approx(float(want), rel=1e-4)
    for text in negatives:  # every token of every negative text sits in the dead zone
        seq = encode_prompt(tok, text)
        h = down_proj_inputs(model, tok, [seq], [range(len(seq))], 1)[0]
        assert float(aloe_gates(h.double(), op).max()) == 0.0


def test_rewording_retrieval_finds_a_rewording_that_is_its_request():
    model, tok = tiny_model("llama", num_layers=3), tiny_tokenizer()
    reqs = [
        EditRequest(prompt=e.prompt, target_new=e.target_new, subject=e.subject, rephrases=(e.prompt,), id=str(i))
        for i, e in enumerate(EDITS)
    ]
    got = rewording_retrieval(model, tok, reqs, [1])
    assert got["edits"] == got["rewordings"] == 2 and got["chance"] == 0.5
    assert got["layer1/last_token"]["mean"] == got["layer1/subject_last_token"]["mean"] == 1.0


def test_probe_produces_agrees_with_greedy_decoding():
    # tiny GPT-2 continues this prompt with a word of the tokenizer, so one case below must be true
    model, tok = tiny_model("gpt2"), tiny_tokenizer()
    prompt = "The capital of France is"
    greedy = greedy_generate(model, [tok(prompt)["input_ids"]], 3, pad_id=1)[0]
    own = tok.convert_ids_to_tokens(greedy[0])
    words = ["Rome", "Paris", "guitar", "the", "of", "is", "and", ".", "piano", "city", own]
    verdicts = []
    for w in words:
        _, t = encode_continuation(tok, prompt, w)
        verdicts.append(produces(model, tok, prompt, w))
        assert verdicts[-1] == (tuple(greedy[: len(t)]) == t), w
    assert verdicts[-1] and not all(verdicts)
