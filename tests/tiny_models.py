"""Tiny random causal LMs built from configs, with a tokenizer trained locally,
so that tests never download anything."""

from __future__ import annotations

import copy
import functools

import torch

_CORPUS = [
    "The Eiffel Tower is located in the city of Paris .",
    "The capital of France is Paris and the capital of Italy is Rome .",
    "Toko Yasuda plays the guitar and John Lennon plays the piano .",
    "What is the product made by UniFirst ? uniform .",
    "the a an of in on is was by with for to from and or not",
    "0 1 2 3 4 5 6 7 8 9 . , ? ! ' \" : ;",
]


#: A chat template for the tiny tokenizer: every message as "role : content ." and the assistant's turn.
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} . {% endfor %}"
    "{% if add_generation_prompt %}assistant : {% endif %}"
)


def tiny_tokenizer():
    """A word-level tokenizer trained on a few sentences (vocab < 128), a fresh copy each call: a
    test that gives it a chat template must not give one to the tests after it."""
    return copy.deepcopy(_trained_tokenizer())


@functools.lru_cache(maxsize=None)
def _trained_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(_CORPUS, trainers.WordLevelTrainer(special_tokens=["<unk>", "<pad>", "<eos>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="<eos>")
    fast.padding_side = "left"
    return fast


def tiny_model(family: str, seed: int = 0, num_layers: int = 3) -> torch.nn.Module:
    """A randomly initialised causal LM of the given family ('llama', 'qwen2', 'qwen3', 'gpt2')."""
    import transformers as tf

    vocab = 128
    common = dict(vocab_size=vocab, pad_token_id=1, eos_token_id=2, bos_token_id=2)
    if family == "gpt2":
        config = tf.GPT2Config(n_embd=32, n_layer=num_layers, n_head=2, n_positions=64, **common)
    else:
        cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config}[family]
        config = cls(
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=num_layers,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=64,
            **common,
        )
        if family == "qwen3":
            config.head_dim = 16
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    model.eval()
    model.requires_grad_(False)
    return model
