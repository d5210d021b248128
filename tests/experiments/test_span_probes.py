"""The question-span probes of experiments/ (``span_states``, ``span_address_fit``): where a question's
span starts, which prompts ask which edit's fact, the scores, and the address fit, on tiny inputs."""

from __future__ import annotations

import torch

from aloe_build.data import EditRequest
from aloe_kernels.hf import locate_down_proj
from experiments.span_address_fit import fit_addresses, score
from experiments.span_states import asked_edit, span_readings, span_start_token
from tests.tiny_models import tiny_model, tiny_tokenizer

EDITS = [
    EditRequest(prompt="The capital of France is", target_new="Rome", subject="France"),
    EditRequest(prompt="Toko Yasuda plays the", target_new="piano", subject="Toko Yasuda"),
]


def test_the_span_is_the_text_after_the_last_sentence_end():
    tok = tiny_tokenizer()
    ids, first = span_start_token(tok, "Toko Yasuda plays the")
    assert first == 0
    ids, first = span_start_token(tok, "The capital of France is Rome. Toko Yasuda plays the")
    assert tok.decode(ids[first:]).strip() == "Toko Yasuda plays the"
    ids, first = span_start_token(tok, "The capital of France is Rome.\nToko Yasuda plays the")
    assert tok.decode(ids[first:]).strip() == "Toko Yasuda plays the"


def test_a_prompt_asks_the_edit_whose_request_ends_it():
    rows = [
        (0, "request", "The capital of France is"),
        (0, "rephrase", "France's capital is"),
        (0, "distracted", "The capital of France is Rome. Toko Yasuda plays the"),  # asks edit 1
        (0, "distracted", "The capital of France is Rome. John Lennon plays the"),  # asks nothing edited
        (1, "same_subject", "Toko Yasuda is a citizen of"),
        (1, "neighbour", "John Lennon plays the"),
    ]
    assert asked_edit(rows, EDITS) == [0, 0, 1, None, None, None]
    initials = [EditRequest(prompt="Which position did Andrew F. Warga hold?", target_new="mayor", subject="Andrew F. Warga")]
    stated = [(0, "distracted", "The capital of France is Rome. Which position did Andrew F. Warga hold?")]
    assert asked_edit(stated, EDITS + initials) == [2]  # a sentence end inside the request is not its start


def test_span_readings_pool_only_the_question_after_a_statement():
    model, tok = tiny_model("llama", num_layers=3), tiny_tokenizer()
    texts = ["Toko Yasuda plays the", "The capital of France is Rome. Toko Yasuda plays the"]
    r = span_readings(model, tok, texts, [1])[1]  # left-padded batch of both
    for k, text in enumerate(texts):  # against one unpadded pass per text, its states taken by hand
        ids, first = span_start_token(tok, text)
        box = {}
        hook = locate_down_proj(model, 1).module.register_forward_pre_hook(lambda m, a: box.update(h=a[0][0].double()))
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
        hook.remove()
        span = box["h"][first:]
        unit = torch.nn.functional.normalize
        assert torch.allclose(r["last_token"][k], unit(span[-1], dim=-1), atol=1e-5)
        assert torch.allclose(r["span_raw_mean"][k], unit(span.mean(0), dim=-1), atol=1e-5)
        assert torch.allclose(r["span_unit_mean"][k], unit(unit(span, dim=-1).mean(0), dim=-1), atol=1e-5)
        # the running mean reads the whole prompt, each token weighing 0.7 times the next
        units = unit(box["h"], dim=-1)
        by_hand = sum(0.7 ** (len(ids) - 1 - t) * units[t] for t in range(len(ids)))
        assert torch.allclose(r["ema_0.7"][k], unit(by_hand, dim=-1), atol=1e-5)
    assert len(span_start_token(tok, texts[1])[0]) - span_start_token(tok, texts[1])[1] == len(
        span_start_token(tok, texts[0])[0]
    )  # the second text's span is the first text's tokens


def test_score_counts_own_openings_and_prompts_with_no_gate_open():
    rows = [
        (0, "request", "a"),
        (1, "request", "b"),
        (0, "rephrase", "c"),
        (1, "rephrase", "d"),
        (0, "in_context", "e"),
        (1, "in_context", "f"),
        (0, "distracted", "g"),  # asks edit 1 after edit 0's statement
        (0, "distracted", "h"),  # asks nothing
        (0, "same_subject", "i"),
        (1, "neighbour", "j"),
    ]
    asked = [0, 1, 0, 1, 0, 1, 1, None, None, None]
    threshold = torch.tensor([0.5, 0.5])
    # rows x edits: edit 0 opens on a, c, e; edit 1 on b, f, g and on the same-subject prompt i
    s = torch.tensor([[1, 0], [0, 1], [1, 0], [0, 0], [1, 0], [0, 1], [0, 1], [0, 0], [0, 1], [0, 0]], dtype=torch.float64)
    out = score(rows, asked, s, threshold)
    assert out["request/own_opens"] == 1.0
    assert out["rephrase/own_opens"] == 0.5
    assert out["in_context/own_opens"] == 1.0
    assert out["request_after_statement/own_opens"] == 1.0
    assert out["distracted/none_open"] == 1.0
    assert out["same_subject/none_open"] == 0.0
    assert out["same_subject/edit_own_opens"] == 0.0  # it is edit 1 that opens on edit 0's subject
    assert out["neighbour/none_open"] == 1.0
    assert out["asking/other_opens"] == 0.0


def test_fit_addresses_separates_two_clusters():
    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(3, 16, generator=g, dtype=torch.float64), dim=-1)
    x = torch.cat([centres[k] + 0.05 * torch.randn(10, 16, generator=g, dtype=torch.float64) for k in range(3)])
    x = torch.nn.functional.normalize(x, dim=-1)
    pos_of = [0] * 10 + [1] * 10 + [-1] * 10  # the third cluster is a negative of both edits
    W, b, threshold, separable = fit_addresses(x, pos_of, 2, steps=200, decay=1e-6)
    assert separable == 1.0
    opened = (x @ W + b) > threshold
    assert opened[:10, 0].all() and not opened[10:, 0].any()
    assert opened[10:20, 1].all() and not opened[:10, 1].any() and not opened[20:, 1].any()
