"""MEMIT and AlphaEdit: their updates checked against the conditions that define them (float64,
random inputs), and their layer spread checked end to end on a tiny model."""

from __future__ import annotations

import pytest
import torch

from aloe_build.data import EditRequest
from aloe_eval.baselines.alphaedit import alphaedit_update, null_space_projection
from aloe_eval.baselines.layer_inputs import averaged_subject_keys, locatable, residual_at_subjects, subject_keys
from aloe_eval.baselines.memit import memit_update, spread_over_layers
from aloe_eval.baselines.weight_delta import WeightDeltaEditor, zero_deltas
from aloe_kernels.hf import locate_down_proj
from tests.tiny_models import tiny_model, tiny_tokenizer

EDITS = [
    EditRequest(prompt="The capital of France is", target_new="Rome", subject="France"),
    EditRequest(prompt="Toko Yasuda plays the", target_new="piano", subject="Toko Yasuda"),
]


def _spd(d: int, g: torch.Generator) -> torch.Tensor:
    A = torch.randn(d, 2 * d, generator=g, dtype=torch.float64)
    return A @ A.T / (2 * d) + 0.05 * torch.eye(d, dtype=torch.float64)


@pytest.mark.parametrize("n, d, d_out", [(3, 7, 5), (1, 4, 1), (9, 6, 3)])
def test_memit_update_is_the_regularised_least_squares_solution(n, d, d_out):
    g = torch.Generator().manual_seed(n * 100 + d)
    K, R, C = (
        torch.randn(n, d, generator=g, dtype=torch.float64),
        torch.randn(n, d_out, generator=g, dtype=torch.float64),
        _spd(d, g),
    )
    dW = memit_update({2: C}, 0.7)(0, 2, K, R)
    # the minimum of |dW K^T - R^T|^2 + 0.7 tr(dW C dW^T): its gradient vanishes
    grad = (dW @ K.T - R.T) @ K + 0.7 * dW @ C
    torch.testing.assert_close(grad, torch.zeros_like(grad), rtol=0, atol=1e-10)


def test_null_space_projection_keeps_only_the_small_eigen_directions():
    g = torch.Generator().manual_seed(5)
    Q, _ = torch.linalg.qr(torch.randn(6, 6, generator=g, dtype=torch.float64))
    values = torch.tensor([1e-6, 2e-4, 3e-3, 1.0, 2.0, 5.0], dtype=torch.float64)  # mean 1.3672
    C = Q @ torch.diag(values) @ Q.T
    P, kept = null_space_projection(C, 1e-2)  # threshold 0.013672: three directions below
    assert kept == 3
    torch.testing.assert_close(P, Q[:, :3] @ Q[:, :3].T, rtol=0, atol=1e-10)
    # relative: the same directions at any activation scale
    torch.testing.assert_close(null_space_projection(1e4 * C, 1e-2)[0], P, rtol=0, atol=1e-8)


def test_alphaedit_update_leaves_the_usual_keys_and_earlier_edits_alone():
    g = torch.Generator().manual_seed(11)
    d, d_out, n = 8, 4, 2
    Q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
    P = Q[:, :5] @ Q[:, :5].T  # the null space: five directions; the usual keys span the other three
    K = torch.randn(n, d, generator=g, dtype=torch.float64) @ P  # new keys inside the null space
    earlier = torch.randn(3, d, generator=g, dtype=torch.float64) @ P
    R = torch.randn(n, d_out, generator=g, dtype=torch.float64)
    dW = alphaedit_update({0: P}, {0: earlier.T @ earlier}, 1e-3)(0, 0, K, R)
    for usual in Q[:, 5:].T:
        torch.testing.assert_close(dW @ usual, torch.zeros(d_out, dtype=torch.float64), rtol=0, atol=1e-10)
    # the defining equation: (P (K^T K + K_p^T K_p) + l2 I) dW^T = P K^T R
    lhs = (P @ (K.T @ K + earlier.T @ earlier) + 1e-3 * torch.eye(d, dtype=torch.float64)) @ dW.T
    torch.testing.assert_close(lhs, P @ K.T @ R, rtol=0, atol=1e-10)
    # with a small l2, the new keys are written almost exactly and the earlier ones barely move
    assert float((K @ dW.T - R).norm() / R.norm()) < 0.05
    assert float((earlier @ dW.T).norm() / R.norm()) < 0.05


def _residual_one_at_a_time(model, tok, prompt: str, at: int, layer: int) -> torch.Tensor:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tok(prompt)["input_ids"]]), output_hidden_states=True)
    return out.hidden_states[layer + 1][0, at].double()


def test_residual_and_averaged_keys_read_the_unbatched_states():
    model, tok = tiny_model("llama", num_layers=3), tiny_tokenizer()
    prompts, subjects = [e.prompt for e in EDITS], [e.subject for e in EDITS]
    got = residual_at_subjects(model, tok, prompts, subjects, 1, batch_size=2)
    want = torch.stack([_residual_one_at_a_time(model, tok, p, i, 1) for p, i in zip(prompts, (3, 1))])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    groups = [[""], ["The city. ", "I think. ", "You know. "]]
    keys = averaged_subject_keys(model, tok, prompts, subjects, 1, groups)
    plain = subject_keys(model, tok, prompts, subjects, 1).double()
    for i, (p, s) in enumerate(zip(prompts, subjects)):
        prefixed = subject_keys(model, tok, [q + p for q in groups[1]], [s] * 3, 1).double().mean(0)
        torch.testing.assert_close(keys[i], (plain[i] + prefixed) / 2, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layers", [(1,), (0, 1, 2)])
def test_spread_over_layers_writes_the_target_at_the_last_layer(layers):
    # with a negligible regulariser and fewer edits than key dimensions, the last layer takes all that
    # is still missing exactly: the residual after it, at each subject, becomes the target
    model, tok = tiny_model("llama", num_layers=3), tiny_tokenizer()
    prompts, subjects = [e.prompt for e in EDITS], [e.subject for e in EDITS]
    site = locate_down_proj(model, layers[-1])
    g = torch.Generator().manual_seed(2)
    deltas = torch.randn(len(EDITS), site.d_out, generator=g, dtype=torch.float64)
    before = residual_at_subjects(model, tok, prompts, subjects, layers[-1])
    originals = {layer: locate_down_proj(model, layer).weight().detach().clone() for layer in layers}
    eye = {layer: torch.eye(locate_down_proj(model, layer).d, dtype=torch.float64) for layer in layers}
    editor = WeightDeltaEditor("MEMIT", "memit", zero_deltas(model, layers))
    spread_over_layers(model, tok, EDITS, layers, deltas, [[""]], memit_update(eye, 1e-9), editor)
    assert all(torch.equal(locate_down_proj(model, la).weight(), w) for la, w in originals.items())
    editor.attach(model)
    try:
        after = residual_at_subjects(model, tok, prompts, subjects, layers[-1])
    finally:
        editor.detach(model)
    torch.testing.assert_close(after, before + deltas, rtol=1e-4, atol=1e-4)
    assert all(torch.equal(locate_down_proj(model, la).weight(), w) for la, w in originals.items())
    if len(layers) > 1:  # the earlier layers carried a share
        assert all(float(editor.deltas[la].norm()) > 0 for la in layers)


def test_a_weight_editors_state_key_follows_its_deltas_not_its_timings():
    g = torch.Generator().manual_seed(3)
    deltas = {1: torch.randn(7, 5, generator=g), 2: torch.randn(7, 5, generator=g)}
    first = WeightDeltaEditor("MEMIT", "memit", deltas, {"fit_s": 1.5})
    assert first.state_key() == WeightDeltaEditor("MEMIT", "memit", dict(deltas), {"fit_s": 9.0}).state_key()
    moved = {1: deltas[1], 2: deltas[2].clone().index_put_((torch.tensor([0]), torch.tensor([0])), torch.tensor(1e3))}
    assert first.state_key() != WeightDeltaEditor("MEMIT", "memit", moved, {"fit_s": 1.5}).state_key()
    assert first.state_key() != WeightDeltaEditor("AlphaEdit", "alphaedit", deltas, {"fit_s": 1.5}).state_key()


def test_locatable_sets_aside_requests_whose_subject_merges_with_the_text():
    tok = tiny_tokenizer()
    bad = EditRequest(prompt="The capital of Italy is", target_new="Paris", subject="France")
    keep, skipped = locatable(tok, [EDITS[0], bad, EDITS[1]], ["", "The city. "])
    assert keep == [EDITS[0], EDITS[1]] and len(skipped) == 1
