"""experiments.prompt_gates: the gates it reports are the float64 reference's on the prompt's own states,
at the last token and over the whole prompt, with the plain and the running reading."""

from __future__ import annotations

import pytest
import torch

from aloe_build.tokens import encode_prompt
from aloe_eval.baselines.layer_inputs import down_proj_inputs
from aloe_kernels import AloeOperator
from aloe_kernels.hf import locate_down_proj
from aloe_kernels.reference import aloe_gates
from experiments.prompt_gates import prompt_gates
from tests.tiny_models import tiny_model, tiny_tokenizer

LAYER = 1
REQUESTS = ["The capital of France is", "Toko Yasuda plays the"]
PROMPTS = [*REQUESTS, "John Lennon plays the guitar and", "Rome"]


def _readings(h: torch.Tensor, decay: float) -> torch.Tensor:
    """r_t = decay * r_(t-1) + h_t / |h_t|, written out token by token."""
    out, r = [], torch.zeros(h.shape[1], dtype=torch.float64)
    for row in h.double():
        r = decay * r + row / row.norm()
        out.append(r)
    return torch.stack(out)


@pytest.mark.parametrize("decay", [0.0, 0.6])
def test_reported_gates_are_the_reference_gates_of_the_prompts_states(decay):
    model, tok = tiny_model("llama", num_layers=3), tiny_tokenizer()
    seqs = [encode_prompt(tok, p) for p in PROMPTS]
    states = down_proj_inputs(model, tok, seqs, [range(len(s)) for s in seqs], LAYER)
    readings = [_readings(h, decay) for h in states]
    g = torch.Generator().manual_seed(3)
    # each request's slot addressed at its own last reading, so it opens there and less elsewhere
    addresses = torch.stack([readings[i][-1] / readings[i][-1].norm() for i in range(len(REQUESTS))])
    op = AloeOperator(
        addresses=addresses.double(),
        thresholds=torch.tensor([0.6, 0.7], dtype=torch.float64),
        temperatures=torch.tensor([12.0, 9.0], dtype=torch.float64),
        writes=torch.randn(len(REQUESTS), locate_down_proj(model, LAYER).d_out, generator=g, dtype=torch.float64),
        edits=[{"id": f"e{i}", "request": r, "target": "t", "subject": None} for i, r in enumerate(REQUESTS)],
        layer=LAYER,
        reading_decay=decay,
    )
    before = [p.detach().clone() for p in model.parameters()]
    rows = prompt_gates(op, model, tok, PROMPTS, top=2)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))  # the patch is undone
    assert [r["prompt"] for r in rows] == PROMPTS
    for row, r in zip(rows, readings):
        want = aloe_gates(r, op)  # (T, n), float64
        last = want[-1]
        open_slots = [int(i) for i in last.argsort(descending=True) if last[i] > 0][:2]
        assert [g["slot"] for g in row["last_token"]] == open_slots
        for got in row["last_token"]:
            assert got["gate"] == pytest.approx(float(last[got["slot"]]), abs=2e-4)
            assert got["request"] == REQUESTS[got["slot"]]
        assert row["max_over_prompt"] == pytest.approx(float(want.max()), abs=2e-4)
    assert rows[0]["last_token"][0]["slot"] == 0 and rows[1]["last_token"][0]["slot"] == 1
