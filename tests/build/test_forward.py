"""Batched forward passes and the shared tokenization: teacher-forced scoring and greedy generation
against plain Hugging Face calls."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer

from aloe_build.forward import greedy_generate, teacher_forced
from aloe_build.tokens import encode_continuation, pad_id


@pytest.fixture(scope="module")
def tiny():
    return tiny_model("llama"), tiny_tokenizer()


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
    mine = greedy_generate(model, [tok(p)["input_ids"] for p in prompts], [4, 2, 3], pad_id=pad_id(tok),
                           batch_size=2)
    assert mine == [ref[0], ref[1][:2], ref[2][:3]]


def test_teacher_forced_matches_single_forward(tiny):
    model, tok = tiny
    seqs = [encode_continuation(tok, "The capital of France is", "Rome Paris"),
            encode_continuation(tok, "Toko Yasuda plays the", "guitar")]
    res = teacher_forced(model, seqs, pad_id=pad_id(tok), batch_size=2, hidden=True)
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
