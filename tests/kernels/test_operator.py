"""The operator artifact: round trip, every validation error, append/remove/merge."""

import json

import pytest
import torch
from helpers import random_operator
from safetensors.torch import load_file, save_file

from aloe_kernels import AloeOperator, ArtifactError
from aloe_kernels.operator import CONFIG_NAME, TENSORS_NAME


def _edits(n, prefix="e"):
    return [{"id": f"{prefix}{i}", "request": f"req {i}", "target": f"t{i}", "subject": f"s{i}"} for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_round_trip_bit_exact(tmp_path, dtype):
    op = random_operator(
        7,
        19,
        5,
        dtype=dtype,
        edits=_edits(7),
        layer=3,
        module_path="model.layers.3.mlp.down_proj",
        base_model="tiny",
        weight_fingerprint="sha256-bf16:abc",
    )
    op.save(tmp_path / "art")
    back = AloeOperator.load(tmp_path / "art", device=op.device)
    for k in ("addresses", "thresholds", "temperatures", "writes"):
        a, b = getattr(op, k), getattr(back, k)
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert back.edits == op.edits and back.layer == 3 and back.module_path == op.module_path
    assert (back.eps, back.gate_eps, back.base_model, back.weight_fingerprint) == (1e-6, 1e-3, "tiny", "sha256-bf16:abc")
    assert back.fingerprint() == op.fingerprint()
    config = json.loads((tmp_path / "art" / CONFIG_NAME).read_text())
    assert config["n"] == 7 and config["d"] == 19 and config["d_out"] == 5 and config["format_version"] == 1


def test_construct_directly_with_keywords():
    op = AloeOperator(
        addresses=torch.zeros(2, 4), thresholds=torch.zeros(2), temperatures=torch.ones(2), writes=torch.zeros(2, 3)
    )
    assert (op.n, op.d, op.d_out, op.eps, op.gate_eps) == (2, 4, 3, 1e-6, 1e-3)
    assert op.ids == ["edit-0", "edit-1"]


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("addresses", torch.zeros(3, 4, 1), "addresses.*shape"),
        ("thresholds", torch.zeros(2), "thresholds.*shape"),
        ("writes", torch.zeros(2, 5), "writes.*shape"),
        ("temperatures", torch.tensor([1.0, 0.0, 1.0]), "temperatures.*> 0"),
        ("thresholds", torch.tensor([0.0, float("nan"), 0.0]), "thresholds.*finite"),
        ("writes", torch.full((3, 5), float("inf")), "writes.*finite"),
        ("addresses", torch.zeros(3, 4, dtype=torch.int32), "addresses.*float"),
        ("thresholds", torch.zeros(3, dtype=torch.float64), "one dtype"),
        ("edits", [{"id": "a"}, {"id": "a"}, {"id": "b"}], "duplicate"),
        ("edits", [{"id": "a"}], "3 metadata"),
        ("eps", 0.0, "eps"),
        ("gate_eps", 1.0, "gate_eps"),
    ],
)
def test_construction_validation(field, value, match):
    kw = dict(addresses=torch.zeros(3, 4), thresholds=torch.zeros(3), temperatures=torch.ones(3), writes=torch.zeros(3, 5))
    kw[field] = value
    with pytest.raises(ArtifactError, match=match):
        AloeOperator(**kw)


@pytest.fixture
def saved(tmp_path):
    op = random_operator(4, 8, 6, edits=_edits(4), weight_fingerprint="sha256-bf16:1234")
    return op, op.save(tmp_path / "art")


def _rewrite_tensor(path, name, value):
    tensors = load_file(str(path / TENSORS_NAME))
    tensors[name] = value
    save_file(tensors, str(path / TENSORS_NAME))


def _rewrite_config(path, **changes):
    config = json.loads((path / CONFIG_NAME).read_text())
    config.update(changes)
    (path / CONFIG_NAME).write_text(json.dumps(config))


def test_load_missing_dir(tmp_path):
    with pytest.raises(ArtifactError, match="artifact directory"):
        AloeOperator.load(tmp_path / "nope")


@pytest.mark.parametrize("name", [CONFIG_NAME, TENSORS_NAME])
def test_load_missing_file(saved, name):
    _, path = saved
    (path / name).unlink()
    with pytest.raises(ArtifactError, match=f"{name}: file missing"):
        AloeOperator.load(path)


def test_load_truncated_safetensors(saved):
    _, path = saved
    data = (path / TENSORS_NAME).read_bytes()
    (path / TENSORS_NAME).write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="not a readable safetensors"):
        AloeOperator.load(path)


def test_load_bad_json(saved):
    _, path = saved
    (path / CONFIG_NAME).write_text("{not json")
    with pytest.raises(ArtifactError, match="not valid JSON"):
        AloeOperator.load(path)


def test_load_wrong_shape(saved):
    _, path = saved
    _rewrite_tensor(path, "writes", torch.zeros(4, 7))
    with pytest.raises(ArtifactError, match=r"writes.*expected shape \(4, 6\)"):
        AloeOperator.load(path)


def test_load_wrong_dtype(saved):
    _, path = saved
    _rewrite_tensor(path, "thresholds", torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ArtifactError, match="thresholds.*dtype float32"):
        AloeOperator.load(path)


def test_load_nan(saved):
    _, path = saved
    _rewrite_tensor(path, "addresses", torch.full((4, 8), float("nan")))
    with pytest.raises(ArtifactError, match="addresses.*finite"):
        AloeOperator.load(path)


def test_load_missing_tensor(saved):
    _, path = saved
    tensors = load_file(str(path / TENSORS_NAME))
    del tensors["temperatures"]
    save_file(tensors, str(path / TENSORS_NAME))
    with pytest.raises(ArtifactError, match="temperatures.*missing"):
        AloeOperator.load(path)


def test_load_bad_version(saved):
    _, path = saved
    _rewrite_config(path, format_version=99)
    with pytest.raises(ArtifactError, match="format_version.*expected 1 or 2"):
        AloeOperator.load(path)


def test_load_wrong_fingerprint(saved):
    _, path = saved
    with pytest.raises(ArtifactError, match="fingerprint"):
        AloeOperator.load(path, expected_fingerprint="sha256-bf16:other")
    assert AloeOperator.load(path, expected_fingerprint="sha256-bf16:1234").n == 4


def test_append_remove_merge():
    a = random_operator(3, 8, 4, edits=_edits(3, "a"), seed=1)
    b = random_operator(2, 8, 4, edits=_edits(2, "b"), seed=2)
    ab = a.append(b)
    assert ab.n == 5 and ab.ids == ["a0", "a1", "a2", "b0", "b1"]
    assert torch.equal(ab.writes[3:], b.writes) and torch.equal(ab.addresses[:3], a.addresses)
    back = ab.remove(["b0", "b1"])
    assert torch.equal(back.addresses, a.addresses) and back.ids == a.ids
    mid = ab.remove(["a1"])
    assert mid.ids == ["a0", "a2", "b0", "b1"] and torch.equal(mid.thresholds[1], a.thresholds[2])
    c = random_operator(1, 8, 4, edits=_edits(1, "c"), seed=3)
    assert AloeOperator.merge([a, b, c]).ids == ["a0", "a1", "a2", "b0", "b1", "c0"]
    empty = ab.remove(ab.ids)
    assert empty.n == 0 and empty.d == 8


def test_merge_refusals():
    a = random_operator(3, 8, 4, edits=_edits(3, "a"), layer=2)
    with pytest.raises(ArtifactError, match="duplicate"):
        a.append(a)
    with pytest.raises(ArtifactError, match="d, d_out"):
        a.append(random_operator(1, 9, 4, edits=_edits(1, "z")))
    with pytest.raises(ArtifactError, match="layer"):
        a.append(random_operator(1, 8, 4, edits=_edits(1, "z"), layer=5))
    with pytest.raises(ArtifactError, match="unknown edit ids"):
        a.remove(["nope"])


def test_to_device_dtype():
    op = random_operator(3, 8, 4)
    half = op.to("cpu", torch.bfloat16)
    assert half.dtype == torch.bfloat16 and op.dtype == torch.float32 and half.ids == op.ids
