"""One tokenization and padding convention, shared by construction and evaluation.

A prompt is tokenized as the model sees it for generation (special tokens
included, a trailing EOS that some tokenizers append dropped). A target (or
any answer) is the continuation of its prompt: the tokens that follow the
prompt's own tokens in the tokenization of ``prompt + " " + target``, so the
tokens a build trains on are the tokens an evaluation scores and a served
model generates.
"""

from __future__ import annotations

from typing import Sequence

import torch


def encode_prompt(tokenizer, text: str, special: bool = True) -> list[int]:
    """Token ids of ``text`` as a prompt (special tokens included unless ``special`` is false)."""
    ids = list(tokenizer(text, add_special_tokens=special)["input_ids"])
    eos = tokenizer.eos_token_id
    # a tokenizer that appends EOS would put it between the prompt and its continuation
    if special and ids and eos is not None and ids[-1] == eos and eos != tokenizer.bos_token_id:
        ids = ids[:-1]
    return ids


def encode_continuation(tokenizer, prompt: str, text: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(prompt_ids, continuation_ids)`` for ``prompt + " " + text``.

    The continuation is what follows the prompt's tokens in the tokenization
    of ``prompt + " " + text``; if that tokenization does not start with the
    prompt's tokens (a merge across the boundary), it is ``" " + text``
    tokenized on its own.
    """
    p = encode_prompt(tokenizer, prompt)
    f = encode_prompt(tokenizer, prompt + " " + text.strip())
    if len(f) > len(p) and f[: len(p)] == p:
        cont = f[len(p) :]
    else:
        cont = encode_prompt(tokenizer, " " + text.strip(), special=False)
    if not cont:
        raise ValueError(f"{text!r} tokenizes to no tokens after {prompt!r}")
    return tuple(p), tuple(cont)


def chat_prompt(tokenizer, question: str | Sequence[str], system: str | None = None) -> list[int]:
    """Token ids of ``question`` as the user turn of the model's chat template (a sequence of texts:
    consecutive user turns), ready for the assistant's answer; ``system`` None keeps the template's
    own default system prompt."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template")
    turns = [question] if isinstance(question, str) else list(question)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": t} for t in turns]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return encode_prompt(tokenizer, text, special=False)


def chat_header_length(tokenizer, system: str | None = None) -> int:
    """How many tokens every chat prompt starts with (the template's system turn and the opening of
    the user turn): their states are the same whatever the question. Counted as the tokens of the
    text before the question that a chat prompt starts with (a token merged across the boundary is
    not counted)."""
    mark = "\x00"
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": mark}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head = encode_prompt(tokenizer, text[: text.index(mark)], special=False)
    return common_prefix_length(head, chat_prompt(tokenizer, "Question", system))


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens two sequences share: the first index where they differ, or the
    shorter one's length if it is a prefix of the other."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def chat_template_key(tokenizer, systems: Sequence[str] = ()) -> str:
    """A short hash of the tokenizer's chat template and of any ``systems`` prompts asked after
    besides its default (what chat-form states depend on besides the weights)."""
    import hashlib

    text = str(getattr(tokenizer, "chat_template", "")) + "".join("\x00" + s for s in systems)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def chat_answer(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` as the start of an assistant turn (no leading space)."""
    ids = encode_prompt(tokenizer, text.strip(), special=False)
    if not ids:
        raise ValueError(f"{text!r} tokenizes to no tokens")
    return ids


def stop_ids(tokenizer) -> set[int]:
    """Token ids after which a server stops generating: EOS and, where the vocabulary has one, the
    chat template's end of turn (``<|im_end|>``), which instruction-tuned models write after a bare
    question as well."""
    end_turn = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in tokenizer.get_vocab() else None
    return {t for t in (tokenizer.eos_token_id, end_turn) if t is not None}


def end_index(tokens: Sequence[int], stops: set[int]) -> int:
    """Index of the first stop token in ``tokens`` (``len(tokens)`` when there is none)."""
    return next((i for i, t in enumerate(tokens) if t in stops), len(tokens))


def until_end(tokens: Sequence[int], stops: set[int]) -> list[int]:
    """``tokens`` up to and including the first stop token: what a served model returns, since it
    stops there and never generates what would follow."""
    return list(tokens[: end_index(tokens, stops) + 1])


def pad_id(tokenizer) -> int:
    """The id used for left padding: the pad token, else the EOS token."""
    pid = tokenizer.pad_token_id
    if pid is None:
        pid = tokenizer.eos_token_id
    if pid is None:
        raise ValueError("the tokenizer has neither a pad token nor an eos token")
    return int(pid)


def left_pad(seqs: Sequence[Sequence[int]], pad: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad token id lists; returns ``(input_ids, attention_mask, position_ids)``.

    Position ids follow the mask, so that padding does not shift absolute
    positions and every row sees positions ``0..len-1`` (as ``model.generate`` does).
    """
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        if len(s):
            ids[i, width - len(s) :] = torch.tensor(list(s), dtype=torch.long)
            mask[i, width - len(s) :] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), pos.to(device)


def batch_inputs(seqs: Sequence[Sequence[int]], pad: int, device) -> dict[str, torch.Tensor]:
    """Left-padded model inputs (``input_ids``, ``attention_mask``, ``position_ids``)."""
    ids, mask, pos = left_pad(seqs, pad, device)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}
