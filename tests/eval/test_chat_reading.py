"""Chat gate diagnostics of an operator whose gates read a running mean: the own gate is read on the
states the gates see, whether or not the operator is patched in at that moment."""

import torch
from helpers import random_operator, running_mean_by_hand
from tiny_models import TINY_CHAT_TEMPLATE, tiny_model, tiny_tokenizer

from aloe_build.data import EditRequest
from aloe_build.tokens import chat_prompt
from aloe_eval.chat import own_gates
from aloe_eval.editors import AloeEditor
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.reading import reading_of

LAYER = 1


def test_own_gate_reads_the_running_mean_of_the_chat_prompt():
    model, tok = tiny_model("llama", num_layers=3), tiny_tokenizer()
    tok.chat_template = TINY_CHAT_TEMPLATE
    requests = [
        EditRequest(prompt="The capital of France is", target_new="Rome", subject="France", id="a"),
        EditRequest(prompt="Toko Yasuda plays the", target_new="piano", subject="Toko Yasuda", id="b"),
    ]
    site = locate_down_proj(model, LAYER)
    box = {}
    hook = site.module.register_forward_pre_hook(lambda m, a: box.update(h=a[0].detach()))
    readings = []
    for r in requests:  # the reading at each chat prompt's last token, by hand
        with torch.no_grad():
            model(input_ids=torch.tensor([chat_prompt(tok, r.prompt, None)]))
        readings.append(torch.nn.functional.normalize(running_mean_by_hand(box["h"], 0.6)[0, -1], dim=-1))
        raw_last = torch.nn.functional.normalize(box["h"][0, -1].double(), dim=-1)
    hook.remove()
    assert float(readings[1] @ raw_last) < 0.95  # the last token alone would read elsewhere
    op = random_operator(2, site.d, site.d_out, dtype=torch.float64, layer=LAYER, reading_decay=0.6)
    op.addresses.copy_(torch.stack(readings))
    op.thresholds.fill_(0.97)
    op.edits = [{"id": "a"}, {"id": "b"}]
    editor = AloeEditor(op.to(dtype=torch.float32), check_fingerprint=False)
    got = own_gates(model, tok, requests, editor, None, hit=[False, False], batch_size=2)
    assert got["open_share"] == 0.0  # outside the editor's reading the states are the raw inputs
    with editor.reading(model):
        got = own_gates(model, tok, requests, editor, None, hit=[False, False], batch_size=2)
    assert got["mapped"] == 2 and got["open_share"] == 1.0 and got["misses"] == {"address": 0, "write": 2}
    assert reading_of(model) is None
