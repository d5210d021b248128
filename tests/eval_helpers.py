"""Shared pieces of the evaluation tests: hand-made operators, a forced-token editor, tiny requests.

``handmade_operator`` builds an ALOE operator without the build pipeline: each
address is the normalized down-projection input at the last prompt token of
its request, thresholds and temperatures open a gate only on (nearly) that
very state, and the writes are fitted by a few Adam steps on the
teacher-forced NLL of the targets.
"""

from __future__ import annotations

import torch

from aloe_build.data import EditRequest
from aloe_build.tokens import encode_continuation, left_pad, pad_id
from aloe_eval import Editor
from aloe_kernels import AloeOperator, apply_aloe, remove_aloe, weight_fingerprint, written_from
from aloe_kernels.hf import locate_down_proj

LAYER = 1


def last_token_states(model, tokenizer, prompts, layer, batch_size=32) -> torch.Tensor:
    """Down-projection input at the last token of each prompt (left padding), (n, d)."""
    site = locate_down_proj(model, layer)
    pad = pad_id(tokenizer)
    seen = {}
    hook = site.module.register_forward_hook(lambda m, a, o: seen.__setitem__("h", a[0].detach()))
    out = []
    try:
        with torch.no_grad():
            for i in range(0, len(prompts), batch_size):
                ids, mask, pos = left_pad([tokenizer(p)["input_ids"] for p in prompts[i : i + batch_size]], pad, "cpu")
                model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
                out.append(seen["h"][:, -1].float())
    finally:
        hook.remove()
    return torch.cat(out)


def handmade_operator(
    model, tokenizer, requests, layer, *, steps=60, lr=0.5, tau=0.99, alpha=600.0, batch_size=32, fit=True
) -> AloeOperator:
    """A test operator: addresses = normalized last-prompt-token states, writes fitted by Adam.

    The own request scores exactly 1 and opens with gate sigmoid(alpha * (1 - tau));
    anything with cosine below ~tau - 7/alpha stays in the dead zone. Stops early
    once every target token is predicted.
    """
    from aloe_build.models import model_name

    site = locate_down_proj(model, layer)
    K = torch.nn.functional.normalize(last_token_states(model, tokenizer, [r.prompt for r in requests], layer), dim=1)
    n = K.shape[0]
    op = AloeOperator(
        addresses=K,
        thresholds=torch.full((n,), tau),
        temperatures=torch.full((n,), alpha),
        writes=torch.zeros(n, site.d_out),
        edits=[
            {"id": r.id or f"edit-{i}", "request": r.prompt, "target": r.target_new, "subject": r.subject}
            for i, r in enumerate(requests)
        ],
        layer=layer,
        module_path=site.path,
        base_model=model_name(model),
        weight_fingerprint=weight_fingerprint(site.weight()),
    )
    if not fit:
        return op
    enc = [encode_continuation(tokenizer, r.prompt, r.target_new) for r in requests]
    pad = pad_id(tokenizer)
    wrapper = apply_aloe(model, op)
    writes = wrapper.writes.requires_grad_(True)
    opt = torch.optim.Adam([writes], lr=lr)
    try:
        for _ in range(steps):
            all_right = True
            for i in range(0, n, batch_size):
                chunk = enc[i : i + batch_size]
                ids, mask, pos = left_pad([list(p) + list(c) for p, c in chunk], pad, "cpu")
                T = ids.shape[1]
                labels = torch.full_like(ids, -100)
                for b, (_, c) in enumerate(chunk):
                    labels[b, T - len(c) - 1 : T - 1] = torch.tensor(c)
                starts = torch.tensor([T - len(c) - 1 for _, c in chunk])  # written as generation writes
                with written_from(model, starts):
                    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
                valid = labels != -100
                all_right &= bool(((logits.argmax(-1) == labels) | ~valid).all())
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100
                )
                opt.zero_grad()
                loss.backward()
                opt.step()
            if all_right:
                break
    finally:
        remove_aloe(model)
    op.writes = writes.detach().clone()
    op.validate()
    return op


class ForceToken(Editor):
    """A model whose LM head always prefers one token (a huge logit bias)."""

    name = "forced"

    def __init__(self, token_id: int, layer: int = LAYER):
        self.token_id = token_id
        self.layer = layer
        self._h = None

    def attach(self, model):
        def hook(_m, _a, out):
            out = out.clone()
            out[..., self.token_id] += 1e4
            return out

        self._h = model.get_output_embeddings().register_forward_hook(hook)

    def detach(self, model):
        self._h.remove()


def tiny_requests():
    return [
        EditRequest(
            "The Eiffel Tower is located in the city of",
            "Rome",
            "Eiffel Tower",
            rephrases=("The capital of France is", "the capital of Italy is"),
            locality=[{"prompt": "Toko Yasuda plays the", "ground_truth": "guitar", "kind": "neighborhood"}],
            portability=[{"prompt": "What is the product made by UniFirst ?", "ground_truth": ["uniform"], "kind": "reasoning"}],
            id="e0",
        ),
        EditRequest(
            "John Lennon plays the",
            "guitar",
            "John Lennon",
            rephrases=("Toko Yasuda plays the",),
            locality=[
                "the capital of Italy is",
                {"prompt": "What is the product made by UniFirst ?", "ground_truth": "uniform", "kind": "nq"},
            ],
            id="e1",
        ),
        EditRequest(
            "The capital of France is",
            "Rome Paris",
            "France",
            locality=[{"prompt": "The Eiffel Tower is located in the", "ground_truth": "city of Paris"}],
            id="e2",
        ),
    ]


def gate_operator(model, tok, reqs, open_: bool):
    h = last_token_states(model, tok, [r.prompt for r in reqs], LAYER)
    site = locate_down_proj(model, LAYER)
    n = h.shape[0]
    g = torch.Generator().manual_seed(0)
    return AloeOperator(
        addresses=torch.nn.functional.normalize(h.double(), dim=1),
        thresholds=torch.full((n,), 0.999 if open_ else 2.0, dtype=torch.float64),
        temperatures=torch.full((n,), 2000.0, dtype=torch.float64),
        writes=torch.randn(n, site.d_out, generator=g, dtype=torch.float64) * 5,
        edits=[{"id": r.id} for r in reqs],
        layer=LAYER,
    )
