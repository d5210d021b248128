"""The running reading (aloe_kernels.reading): its math against a float64 loop, and a patched model
whose gates read it, checked against states taken by hand from unpadded, uncached passes."""

import pytest
import torch
from helpers import random_operator, running_mean_by_hand
from tiny_models import tiny_model

from aloe_kernels import AloeOperator, PatchError, apply_aloe, remove_aloe
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.reading import attach_reading, detach_reading, reading_of, running_unit_sum

LAYER = 1


@pytest.mark.parametrize("T", [1, 7, 33, 70])
@pytest.mark.parametrize("decay", [0.0, 0.5, 0.9])
def test_running_sum_matches_a_float64running_mean_by_hand(T, decay):
    g = torch.Generator().manual_seed(T)
    h = torch.randn(3, T, 13, generator=g)
    h[1, 0] = 0.0  # a zero row stays zero
    valid = torch.rand(3, T, generator=g) > 0.3
    carry = torch.randn(3, 13, generator=g)
    for v, c in ((None, None), (valid, None), (valid, carry)):
        got = running_unit_sum(h, decay, v, c)
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), running_mean_by_hand(h, decay, v, c), atol=1e-5, rtol=1e-5)
    assert running_unit_sum(h.double(), decay).dtype == torch.float64


def _captured(model, **inputs) -> torch.Tensor:
    box = {}
    handle = locate_down_proj(model, LAYER).module.register_forward_pre_hook(lambda m, a: box.update(h=a[0].detach()))
    with torch.no_grad():
        out = model(**inputs)
    handle.remove()
    return box["h"], out


def _gated_residual(op: AloeOperator, reading: torch.Tensor) -> torch.Tensor:
    """U g(r) in float64 from readings r (T, d) taken by hand."""
    op = op.to(dtype=torch.float64)
    scores = torch.nn.functional.normalize(reading.double(), dim=-1) @ op.addresses.T
    g = torch.clamp_min(torch.sigmoid(op.temperatures * (scores - op.thresholds)) - op.gate_eps, 0) / (1 - op.gate_eps)
    return g @ op.writes


def test_a_patched_model_reads_the_running_mean_through_padding_and_the_cache():
    model = tiny_model("llama", num_layers=3)
    site = locate_down_proj(model, LAYER)
    base = site.module
    rows = [[5, 9, 17, 33, 4, 61], [8, 12, 40]]
    decay = 0.6
    # each row alone, unpadded and uncached, then with one more token: the states by hand
    by_hand = [_captured(model, input_ids=torch.tensor([r]))[0][0] for r in rows]
    longer = [_captured(model, input_ids=torch.tensor([r + [7]]))[0][0] for r in rows]
    readings = [running_mean_by_hand(h[None], decay)[0] for h in by_hand]
    # edit 0 opens near row 1's last reading, edit 1 near row 0's; the others stay shut
    op = random_operator(4, site.d, site.d_out, dtype=torch.float64, layer=LAYER, reading_decay=decay)
    op.addresses[0] = torch.nn.functional.normalize(readings[1][-1], dim=-1)
    op.addresses[1] = torch.nn.functional.normalize(readings[0][-1], dim=-1)
    op.thresholds[:2] = 0.9
    op.thresholds[2:] = 2.0
    op = op.to(dtype=torch.float32)
    wrapper = apply_aloe(model, op, write_positions="all")
    seen = {}
    handle = wrapper.register_forward_hook(lambda m, a, out: seen.update(h=a[0].detach(), y=out.detach()))
    try:
        assert reading_of(model) is wrapper.reading and wrapper.reading.decay == decay
        # a left-padded batch of both, prefill: the gates read the running mean of the real tokens only
        ids = torch.tensor([rows[0], [1, 1, 1, *rows[1]]])
        mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]])
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        for b, real in ((0, slice(0, 6)), (1, slice(3, 6))):
            want = base(seen["h"][b, real]).double() + _gated_residual(op, readings[b])
            assert torch.allclose(seen["y"][b, real].double(), want, atol=1e-4)
        assert _gated_residual(op, readings[1][-1:]).abs().sum() > 0  # the check above saw an open gate
        # one decode step through the cache continues each row's running mean
        with torch.no_grad():
            model(
                input_ids=torch.tensor([[7], [7]]),
                attention_mask=torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1),
                past_key_values=out.past_key_values,
                use_cache=True,
            )
        for b in range(2):
            want_r = running_mean_by_hand(longer[b][None], decay)[0][-1:]
            want = base(seen["h"][b]).double() + _gated_residual(op, want_r)
            assert torch.allclose(seen["y"][b].double(), want, atol=1e-4)
    finally:
        handle.remove()
        assert remove_aloe(model) == 1
    assert reading_of(model) is None  # exact undo: no hook left
    assert locate_down_proj(model, LAYER).module is base


def test_attach_shares_one_decay_and_refuses_another():
    model = tiny_model("llama", num_layers=3)
    assert attach_reading(model, 0.0) is None and reading_of(model) is None
    t = attach_reading(model, 0.7)
    assert attach_reading(model, 0.7) is t
    with pytest.raises(PatchError, match="decay"):
        attach_reading(model, 0.5)
    detach_reading(model)
    assert reading_of(model) is t
    detach_reading(model)
    assert reading_of(model) is None
    with pytest.raises(ValueError, match=r"\[0, 1\)"):
        attach_reading(model, 1.0)


def test_artifact_records_the_reading_and_old_artifacts_load(tmp_path):
    plain = random_operator(3, 8, 5, layer=LAYER)
    running = random_operator(3, 8, 5, layer=LAYER, reading_decay=0.7)
    import json

    plain.save(tmp_path / "plain")
    running.save(tmp_path / "running")
    cfg_plain = json.loads((tmp_path / "plain" / "aloe_config.json").read_text())
    cfg_running = json.loads((tmp_path / "running" / "aloe_config.json").read_text())
    assert cfg_plain["format_version"] == 1 and "reading_decay" not in cfg_plain
    assert cfg_running["format_version"] == 2 and cfg_running["reading_decay"] == 0.7
    assert AloeOperator.load(tmp_path / "plain").reading_decay == 0.0
    assert AloeOperator.load(tmp_path / "running").reading_decay == 0.7
    with pytest.raises(Exception, match="reading_decay"):
        plain.append(running)
    cfg_plain["reading_decay"] = 0.5  # a format-1 artifact cannot claim another reading
    (tmp_path / "plain" / "aloe_config.json").write_text(json.dumps(cfg_plain))
    with pytest.raises(Exception, match="reading_decay"):
        AloeOperator.load(tmp_path / "plain")


def test_a_tree_reading_continues_each_nodes_ancestors():
    from aloe_kernels.reading import tree_running_sum

    g = torch.Generator().manual_seed(3)
    # two sequences sharing their first two tokens: nodes 0-1-2 and 0-1-3-4
    parent, depth = [-1, 0, 1, 1, 3], [0, 1, 2, 2, 3]
    h = torch.randn(5, 11, generator=g)
    got = tree_running_sum(h, parent, depth, 0.7)
    first = running_mean_by_hand(h[[0, 1, 2]][None], 0.7)[0]
    second = running_mean_by_hand(h[[0, 1, 3, 4]][None], 0.7)[0]
    assert torch.allclose(got[[0, 1, 2]].double(), first, atol=1e-5)
    assert torch.allclose(got[[0, 1, 3, 4]].double(), second, atol=1e-5)
