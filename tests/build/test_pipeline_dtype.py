"""A build on a bfloat16 model (the GPU default) runs every stage and gives a working float32 operator."""

from __future__ import annotations

import torch
from test_pipeline import _edits, _tiny_cfg
from tiny_models import tiny_model, tiny_tokenizer

from aloe_build.pipeline import build_operator
from aloe_build.states import last_token_states
from aloe_kernels import aloe_gates, weight_fingerprint
from aloe_kernels.hf import locate_down_proj


def test_bfloat16_model_builds_an_operator_that_opens_on_its_requests(tmp_path):
    model32, tok = tiny_model("llama"), tiny_tokenizer()
    model = tiny_model("llama").to(torch.bfloat16)
    op = build_operator(model, tok, _edits()[:3], _tiny_cfg(tmp_path, refine_steps=200), out_dir=tmp_path / "r", log=None)
    assert op.addresses.dtype == op.writes.dtype == op.thresholds.dtype == torch.float32
    assert all(bool(torch.isfinite(t).all()) for t in (op.addresses, op.thresholds, op.temperatures, op.writes))
    # the fingerprint is that of the checkpoint, whatever the precision it was loaded in
    assert op.weight_fingerprint == weight_fingerprint(locate_down_proj(model32, 1).weight())
    h = last_token_states(model, tok, [e.prompt for e in _edits()[:3]], 1)
    assert (aloe_gates(h, op).diagonal() > 0).all()


def test_bfloat16_negatives_change_only_the_edit_negatives(tmp_path):
    """``negatives_dtype="bfloat16"`` runs the passes behind each edit's negatives under autocast:
    those states move by bfloat16 rounding, while the anchors and the shared pool are the float32 ones."""
    from safetensors.torch import load_file

    model, tok = tiny_model("llama"), tiny_tokenizer()
    rolled = {}
    for name in ("float32", "bfloat16"):
        cfg = _tiny_cfg(tmp_path, negatives_dtype=name, refine_steps=2, target_steps=1, finetune_steps=1)
        build_operator(model, tok, _edits()[:3], cfg, out_dir=tmp_path / name, log=None)
        rolled[name] = load_file(str(tmp_path / name / "checkpoints" / "3_rollouts.safetensors"))
    a, b = rolled["float32"], rolled["bfloat16"]
    assert torch.equal(a["anchors"], b["anchors"]) and torch.equal(a["pool"], b["pool"])
    assert a["specific"].shape == b["specific"].shape and torch.equal(a["specific_owner"], b["specific_owner"])
    gap = (a["specific"] - b["specific"]).norm(dim=-1)
    # unit rows: bfloat16 rounding moves them, but by far less than their length
    assert 0 < float(gap.max()) < 0.2
    assert b["specific"].dtype == torch.float32


def test_pass_precisions_are_checked():
    import pytest

    from aloe_build.config import BuildConfig

    for name in ("compute_dtype", "negatives_dtype"):
        with pytest.raises(ValueError, match=name):
            BuildConfig(**{name: "float16"})


def test_bfloat16_on_a_cpu_without_it_warns(monkeypatch):
    """A CPU without bfloat16 instructions emulates it (several times slower than float32): asking
    for bfloat16 passes there warns; float32 passes, or a CPU that has the instructions, do not."""
    import warnings

    import pytest

    from aloe_build import forward

    model = tiny_model("llama")
    monkeypatch.setattr(forward, "fast_bf16_cpu", lambda: False)
    with pytest.warns(RuntimeWarning, match="no bfloat16 instructions"):
        ctx = forward.in_precision(model, "bfloat16")
    with ctx:
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16 and torch.is_autocast_enabled("cpu")
    monkeypatch.setattr(forward, "fast_bf16_cpu", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        forward.in_precision(model, "bfloat16")
        monkeypatch.setattr(forward, "fast_bf16_cpu", lambda: False)
        with forward.in_precision(model, "float32"):
            assert not torch.is_autocast_enabled("cpu")
