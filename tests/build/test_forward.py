"""Batched forward passes and the shared tokenization: teacher-forced scoring and greedy generation
against plain Hugging Face calls."""

from __future__ import annotations

import pytest
import torch
from helpers import operator_opening_on
from tiny_models import tiny_model, tiny_tokenizer

from aloe_build.forward import generate_with_states, greedy_generate, teacher_forced
from aloe_build.tokens import encode_continuation, pad_id
from aloe_kernels import AloeOperator, apply_aloe, remove_aloe
from aloe_kernels.hf import locate_down_proj


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
    ref = ref[:, batch["input_ids"].shape[1] :].tolist()
    mine = greedy_generate(model, [tok(p)["input_ids"] for p in prompts], [4, 2, 3], pad_id=pad_id(tok), batch_size=2)
    assert mine == [ref[0], ref[1][:2], ref[2][:3]]


@pytest.mark.parametrize("batch_size", [1, 2, 8])
def test_generate_with_states_matches_generate_then_a_pass(tiny, batch_size):
    """The states captured while generating are those of one float64 pass over the prompt and its
    generation, from each start to the last generated token; the tokens are greedy_generate's."""
    import copy

    from aloe_kernels.hf import locate_down_proj

    model, tok = tiny
    layer = 1
    prompts = [
        tok(p)["input_ids"]
        for p in (
            "The Eiffel Tower is located in the city of",
            "the capital of Italy is",
            "Toko",
            "What is the product made by UniFirst ?",
        )
    ]
    lengths, starts = [4, 0, 3, 1], [len(prompts[0]), 2, 0, len(prompts[3]) - 1]
    tokens, states = generate_with_states(
        model, prompts, lengths, layer, starts=starts, pad_id=pad_id(tok), batch_size=batch_size
    )
    assert tokens == greedy_generate(model, prompts, lengths, pad_id=pad_id(tok), batch_size=batch_size)
    ref_model = copy.deepcopy(model).double()
    site = locate_down_proj(ref_model, layer).module
    for p, g, s, got in zip(prompts, tokens, starts, states):
        seen = {}
        handle = site.register_forward_pre_hook(lambda _m, args: seen.update(h=args[0]))
        with torch.no_grad():
            ref_model(input_ids=torch.tensor([list(p) + list(g)]))
        handle.remove()
        want = seen["h"][0, s:]
        want = want / want.norm(dim=-1, keepdim=True)
        assert got.dtype == torch.float32 and got.shape == (len(p) + len(g) - s, want.shape[-1])
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    # by default the states of the generated tokens only
    _, default = generate_with_states(model, prompts[:1], 2, layer, pad_id=pad_id(tok))
    torch.testing.assert_close(default[0], states[0][:2])
    with pytest.raises(ValueError, match="starts"):
        generate_with_states(model, prompts[:1], 2, layer, starts=[len(prompts[0]) + 1], pad_id=pad_id(tok))


def test_teacher_forced_matches_single_forward(tiny):
    model, tok = tiny
    seqs = [
        encode_continuation(tok, "The capital of France is", "Rome Paris"),
        encode_continuation(tok, "Toko Yasuda plays the", "guitar"),
    ]
    res = teacher_forced(model, seqs, pad_id=pad_id(tok), batch_size=2, hidden=True)
    for (p, c), r in zip(seqs, res):
        with torch.no_grad():
            out = model(input_ids=torch.tensor([list(p) + list(c)]), output_hidden_states=True)
        lp = torch.log_softmax(out.logits[0].float(), -1)
        want = lp[len(p) - 1 : len(p) - 1 + len(c)].argmax(-1).tolist()
        assert list(r.preds) == want
        nll = -lp[len(p) - 1 : len(p) - 1 + len(c)].gather(1, torch.tensor(c)[:, None]).mean()
        assert r.nll == pytest.approx(float(nll), abs=1e-4)
        torch.testing.assert_close(r.hidden, out.hidden_states[-1][0, len(p) - 1], atol=1e-4, rtol=1e-4)


def test_teacher_forced_scores_a_patched_model_as_it_generates():
    """With an operator that opens at every prompt position, the teacher-forced predictions of a
    greedy continuation are that continuation (the residual from the prompt's last token on, as
    in generation), in a batch whose rows are padded differently."""
    model, tok = tiny_model("llama"), tiny_tokenizer()
    prompts = [tok(p)["input_ids"] for p in ("The Eiffel Tower is located in the city of", "Toko Yasuda plays the")]
    site = locate_down_proj(model, 1)
    states = {}
    handle = site.module.register_forward_hook(lambda m, a, o: states.update(h=a[0].detach().clone()))
    with torch.no_grad():
        model(input_ids=torch.tensor([prompts[0]]))
    handle.remove()
    op = operator_opening_on(states["h"][0], n_extra=2, d_out=site.d_out)
    apply_aloe(model, AloeOperator(**{k: getattr(op, k) for k in ("addresses", "thresholds", "temperatures", "writes")}, layer=1))
    try:
        gens = greedy_generate(model, prompts, 4, pad_id=pad_id(tok), batch_size=2)
        res = teacher_forced(model, list(zip(prompts, gens)), pad_id=pad_id(tok), batch_size=2)
    finally:
        remove_aloe(model)
    assert [list(r.preds) for r in res] == gens


# ----------------------------------------------------------------------------- metric families
