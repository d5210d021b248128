"""BuildConfig: every field declares its stage, and checkpoints depend on exactly the fields up to theirs."""

from __future__ import annotations

import dataclasses

import pytest

from aloe_build.config import STAGES, BuildConfig


def test_every_field_declares_a_stage():
    for f in dataclasses.fields(BuildConfig):
        assert f.metadata.get("stage") in {0, *STAGES}, f.name


def test_fields_up_to_a_stage_are_those_of_that_stage_and_before():
    cfg = BuildConfig()
    stage_of = {f.name: f.metadata["stage"] for f in dataclasses.fields(cfg)}
    for stage in range(9):
        assert set(cfg.fields_up_to(stage)) == {k for k, s in stage_of.items() if s <= stage}
    # spot checks against the Method section's stages, independent of field names
    assert stage_of["layer"] == stage_of["seed"] == 0
    assert stage_of["max_target_tokens"] == 3 and stage_of["compute_dtype"] == 6 and stage_of["open_gate"] == 5
    assert "finetune_steps" not in cfg.fields_up_to(7) and "finetune_steps" in cfg.fields_up_to(8)
    assert set(cfg.fields_of(1)) == {k for k in stage_of if k.startswith("encoder_")}


def test_from_dict_refuses_unknown_fields():
    assert BuildConfig.from_dict({"refine_steps": 5}).refine_steps == 5
    with pytest.raises(ValueError, match="unknown fields"):
        BuildConfig.from_dict({"positives_prefix_fragments": 2})


def test_chat_systems_take_one_prompt_or_a_list_and_key_the_same_either_way():
    from aloe_build.checkpoints import StageCheckpoints

    assert BuildConfig(chat_systems="Be brief.").chat_systems == ("Be brief.",)
    listed = BuildConfig.from_dict({"chat_systems": ["Be brief.", "Answer in full."]})
    assert listed.chat_systems == ("Be brief.", "Answer in full.")
    again = BuildConfig.from_dict(listed.to_dict())
    assert StageCheckpoints(None, "k", again).key("3_rollouts") == StageCheckpoints(None, "k", listed).key("3_rollouts")
    assert StageCheckpoints(None, "k", BuildConfig()).key("3_rollouts") != StageCheckpoints(None, "k", listed).key("3_rollouts")
    assert StageCheckpoints(None, "k", BuildConfig()).key("2_init") == StageCheckpoints(None, "k", listed).key("2_init")
    for bad in ([""], ["ok", 3]):
        with pytest.raises(ValueError, match="chat_systems"):
            BuildConfig(chat_systems=bad)
