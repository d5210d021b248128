"""The parts the weight editors share (ROME, MEMIT, AlphaEdit): subject keys, the second moment of
a layer's inputs and ROME's rank-one update, each checked against a direct float64 computation."""

from __future__ import annotations

import pytest
import torch

from aloe_eval.baselines.layer_inputs import SubjectNotFound, subject_keys, subject_last_index
from aloe_eval.baselines.rank_one import rank_one_update
from aloe_eval.baselines.second_moments import cached_second_moment, second_moment
from aloe_kernels.hf import locate_down_proj
from tests.tiny_models import _CORPUS, tiny_model, tiny_tokenizer


def _inputs_one_at_a_time(model, tok, text: str, layer: int) -> torch.Tensor:
    """The down-projection inputs of every token of ``text``, from an unbatched full forward pass."""
    seen = {}
    handle = locate_down_proj(model, layer).module.register_forward_pre_hook(
        lambda m, args: seen.__setitem__("h", args[0][0].double())
    )
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([tok(text)["input_ids"]]))
    finally:
        handle.remove()
    return seen["h"]


def test_subject_last_index_counts_the_subjects_tokens():
    tok = tiny_tokenizer()
    assert subject_last_index(tok, "The Eiffel Tower is located in the city of", "The Eiffel Tower") == 2
    assert subject_last_index(tok, "The capital of France is", "France") == 3
    with pytest.raises(SubjectNotFound, match="does not occur"):
        subject_last_index(tok, "The capital of France is", "Italy")


def test_subject_keys_are_the_raw_inputs_at_the_subjects_last_token():
    model, tok = tiny_model("llama"), tiny_tokenizer()
    prompts = ["The Eiffel Tower is located in the city of", "The capital of France is", "Toko Yasuda plays the"]
    subjects = ["The Eiffel Tower", "France", "Toko Yasuda"]
    got = subject_keys(model, tok, prompts, subjects, 1, batch_size=2)  # padded batches of different lengths
    want = torch.stack([_inputs_one_at_a_time(model, tok, p, 1)[i] for p, i in zip(prompts, (2, 3, 1))])
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5)


def test_second_moment_is_the_mean_outer_product_over_every_token(tmp_path, monkeypatch):
    import aloe_eval.baselines.second_moments as sm

    model, tok = tiny_model("llama"), tiny_tokenizer()
    texts = ["The capital of France is Paris .", "Toko Yasuda plays the guitar", "What is the product made by UniFirst ?"]
    k = torch.cat([_inputs_one_at_a_time(model, tok, t, 2) for t in texts])
    want = k.T @ k / k.shape[0]
    got = second_moment(model, tok, texts, 2, batch_size=2)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6)
    first = cached_second_moment(model, tok, texts, 2, tmp_path)

    def never(*a, **k):
        raise AssertionError("the cached second moment should have been read back")

    monkeypatch.setattr(sm, "second_moment", never)
    torch.testing.assert_close(cached_second_moment(model, tok, texts, 2, tmp_path), first, rtol=0, atol=0)
    with pytest.raises(AssertionError, match="read back"):  # another layer is another file
        cached_second_moment(model, tok, texts, 1, tmp_path)


@pytest.mark.parametrize("d, d_out", [(7, 5), (1, 3), (12, 1)])
def test_rank_one_update_maps_the_key_and_is_the_cheapest_such_change(d, d_out):
    g = torch.Generator().manual_seed(d * 100 + d_out)
    W = torch.randn(d_out, d, generator=g).double()  # float32 values, so that a float32 W is the same matrix
    A = torch.randn(d, 3 * d, generator=g, dtype=torch.float64)
    C = A @ A.T / (3 * d) + 0.1 * torch.eye(d, dtype=torch.float64)
    k, v = torch.randn(d, generator=g, dtype=torch.float64), torch.randn(d_out, generator=g, dtype=torch.float64)
    dW = rank_one_update(W.float(), C, k, v)
    torch.testing.assert_close((W + dW) @ k, v, rtol=1e-10, atol=1e-10)
    assert torch.linalg.matrix_rank(dW) == 1
    # keys C^-1-orthogonal to k are left alone
    x = torch.randn(d, generator=g, dtype=torch.float64)
    u = torch.linalg.solve(C, k)
    x = x - (u @ x) / (u @ k) * k
    torch.testing.assert_close(dW @ x, torch.zeros(d_out, dtype=torch.float64), rtol=0, atol=1e-10)
    # any other change that maps k to v costs more in the C-weighted norm tr(dW C dW^T)
    cost = torch.trace(dW @ C @ dW.T)
    for _ in range(20):
        E = torch.randn(d_out, d, generator=g, dtype=torch.float64)
        E = E - torch.outer(E @ k, k) / (k @ k)  # E k = 0: still maps k to v
        other = dW + 0.1 * E
        assert torch.trace(other @ C @ other.T) >= cost - 1e-12


def test_rank_one_update_along_another_direction_still_maps_the_key():
    g = torch.Generator().manual_seed(3)
    W, k, k_dir, v = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((4, 6), (6,), (6,), (4,)))
    C = torch.eye(6, dtype=torch.float64) * 2
    dW = rank_one_update(W, C, k, v, direction=k_dir)
    torch.testing.assert_close((W + dW) @ k, v, rtol=1e-10, atol=1e-10)
    # with C = 2I the change lies along k_dir: keys orthogonal to it are left alone
    x = torch.randn(6, generator=g, dtype=torch.float64)
    x = x - (x @ k_dir) / (k_dir @ k_dir) * k_dir
    torch.testing.assert_close(dW @ x, torch.zeros(4, dtype=torch.float64), rtol=0, atol=1e-10)


def test_rank_one_update_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="shapes"):
        rank_one_update(torch.zeros(3, 4), torch.eye(3), torch.zeros(4), torch.zeros(3))


def _nll_with_delta(model, tok, prompt: str, target: str, at: int, layer: int, delta: torch.Tensor) -> float:
    """Mean NLL of the target after ``prompt`` with ``delta`` added to the layer's MLP output at
    token ``at``, from one unbatched pass."""
    from aloe_build.tokens import encode_continuation

    p, t = encode_continuation(tok, prompt, target)

    def add(module, args, out):
        out = out.clone()
        out[0, at] += delta
        return out

    handle = locate_down_proj(model, layer).module.register_forward_hook(add)
    try:
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([list(p) + list(t[:-1])])).logits[0].double(), -1)
    finally:
        handle.remove()
    return float(-torch.stack([logp[len(p) - 1 + j, t[j]] for j in range(len(t))]).mean())


def test_target_value_lowers_the_target_nll_within_its_clamp_and_is_cached(tmp_path, monkeypatch):
    import aloe_eval.baselines.target_values as tv

    model, tok = tiny_model("llama"), tiny_tokenizer()
    before = [q.detach().clone() for q in model.parameters()]
    prompt, subject, target, layer = "The capital of France is", "France", "Rome", 1
    # no weight decay: it is relative to the layer output, which is tiny in the tiny model
    settings = tv.ValueSettings(steps=15, clamp_factor=2.0, weight_decay=0.0)
    delta, log = tv.optimize_value(model, tok, prompt, subject, target, layer, settings=settings)
    assert log["nll_last"] < log["nll_first"]
    at = subject_last_index(tok, prompt, subject)
    # the reported NLL is that of the final delta, recomputed here on an unbatched pass
    assert _nll_with_delta(model, tok, prompt, target, at, layer, delta) == pytest.approx(log["nll_last"], rel=1e-4)
    assert _nll_with_delta(model, tok, prompt, target, at, layer, 0 * delta) == pytest.approx(log["nll_first"], rel=1e-4)
    h = _inputs_one_at_a_time(model, tok, prompt, layer)[at] @ locate_down_proj(model, layer).weight().double().T
    assert float(delta.norm()) <= 2.0 * float(h.norm()) * (1 + 1e-5)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(q.grad is None for q in model.parameters())
    first = tv.cached_value(model, tok, prompt, subject, target, layer, tmp_path, settings=settings)
    monkeypatch.setattr(tv, "optimize_value", lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed")))
    torch.testing.assert_close(tv.cached_value(model, tok, prompt, subject, target, layer, tmp_path, settings=settings), first)


def test_rome_maps_the_subject_key_to_its_value_and_detach_restores_the_bits(tmp_path):
    from aloe_build.data import EditRequest
    from aloe_eval.baselines.rome import fit_rome
    from aloe_eval.baselines.target_values import ValueSettings

    model, tok = tiny_model("llama"), tiny_tokenizer()
    layer, site = 1, locate_down_proj(model, 1)
    texts = list(_CORPUS)
    C = second_moment(model, tok, texts, layer) + 1e-3 * torch.eye(site.d, dtype=torch.float64)
    edits = [
        EditRequest(prompt="The capital of France is", target_new="Rome", subject="France"),
        EditRequest(prompt="Toko Yasuda plays the", target_new="piano", subject="Toko Yasuda"),
    ]
    original = site.weight().detach().clone()
    settings = ValueSettings(steps=5)
    editor = fit_rome(model, tok, edits, layer, C, tmp_path, settings=settings)
    assert torch.equal(site.weight(), original)  # fitting leaves the model as it was
    from aloe_eval.baselines.target_values import cached_value

    # the first edit's value was optimized on the unedited model: with only it applied, its key maps there
    k = _inputs_one_at_a_time(model, tok, edits[0].prompt, layer)[subject_last_index(tok, edits[0].prompt, "France")]
    delta = cached_value(model, tok, edits[0].prompt, "France", "Rome", layer, tmp_path, settings=settings)
    first = fit_rome(model, tok, edits[:1], layer, C, tmp_path, settings=settings)
    first.attach(model)
    try:
        got = site.weight().double() @ k
    finally:
        first.detach(model)
    torch.testing.assert_close(got, original.double() @ k + delta.double(), rtol=1e-4, atol=1e-4)
    editor.attach(model)
    assert not torch.equal(site.weight(), original)
    editor.detach(model)
    assert torch.equal(site.weight(), original)
    assert torch.linalg.matrix_rank(editor.deltas[editor.layer].double(), rtol=1e-6) == 2


def test_mean_with_se_skips_missing_values():
    from aloe_eval.metrics import mean_with_se

    got = mean_with_se([1.0, 0.0, 1.0, None])  # sample sd sqrt(1/3) over sqrt(3): a third
    assert got["n"] == 3 and got["mean"] == pytest.approx(2 / 3) and got["se"] == pytest.approx(1 / 3)
    assert mean_with_se([None]) is None
