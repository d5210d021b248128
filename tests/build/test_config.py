"""BuildConfig: every field declares its stage, and checkpoints depend on exactly the fields up to theirs."""

from __future__ import annotations

import dataclasses

import pytest

from aloe_build.config import STAGES, BuildConfig


def test_every_field_declares_a_stage_and_a_help_text_and_names_are_unique():
    specs = BuildConfig.field_specs()
    for f in specs:
        assert f.metadata.get("stage") in {0, *STAGES}, f.name
        assert len(f.metadata.get("help", "")) > 10, f.name
    names = [f.name for f in specs]
    assert len(names) == len(set(names))
    assert "positives_chat" in names and "refine_pull" in names and "chat" not in names


def getattr_flat(cfg: BuildConfig, name: str):
    return cfg.to_dict()[name]


def test_fields_up_to_a_stage_are_those_of_that_stage_and_before():
    cfg = BuildConfig()
    stage_of = {f.name: f.metadata["stage"] for f in BuildConfig.field_specs()}
    # a setting added after checkpoints were written keys them only away from its value before it
    before = {f.name: f.metadata["before"] for f in BuildConfig.field_specs() if isinstance(f.metadata["before"], (int, float))}
    assert {"positives_chat_generic_systems", "finetune_keep_after_statement", "reading_decay"} <= set(before)
    away = BuildConfig(**{k: v + 1 if isinstance(v, int) else v + 0.5 for k, v in before.items()})
    then = BuildConfig(**before)
    for stage in range(9):
        assert set(away.fields_up_to(stage)) == {k for k, s in stage_of.items() if s <= stage}
        assert set(then.fields_up_to(stage)) == {k for k, s in stage_of.items() if s <= stage and k not in before}
        assert set(cfg.fields_up_to(stage)) == {
            k for k, s in stage_of.items() if s <= stage and (k not in before or getattr_flat(cfg, k) != before[k])
        }
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

    assert BuildConfig(chat_systems="Be brief.").chat.chat_systems == ("Be brief.",)
    listed = BuildConfig.from_dict({"chat_systems": ["Be brief.", "Answer in full."]})
    assert listed.chat.chat_systems == ("Be brief.", "Answer in full.")
    again = BuildConfig.from_dict(listed.to_dict())
    assert StageCheckpoints(None, "k", again).key("3_rollouts") == StageCheckpoints(None, "k", listed).key("3_rollouts")
    assert StageCheckpoints(None, "k", BuildConfig()).key("3_rollouts") != StageCheckpoints(None, "k", listed).key("3_rollouts")
    assert StageCheckpoints(None, "k", BuildConfig()).key("2_init") == StageCheckpoints(None, "k", listed).key("2_init")
    for bad in ([""], ["ok", 3]):
        with pytest.raises(ValueError, match="chat_systems"):
            BuildConfig(chat_systems=bad)


# Checkpoint keys of each stage for two configurations, computed with the flat BuildConfig of commit
# 8b8945e (before the chat and experimental groups): a build after the change reuses the
# checkpoints and cached encoders written before it.
KEYS_BEFORE_GROUPS = {
    "default": {
        "2_init": "ee6981eb568e5ada",
        "3_rollouts": "9b53a162fd149772",
        "4_refine": "de11559fc1c232d7",
        "5_calibrate": "164f53455aacf645",
        "6_targets": "59a9aceba0544761",
        "7_ridge": "c32e85e64a4ea171",
        "8_finetune": "d5b391167b5a4e38",
        "stage 1 fields": "e94782cd9e8ae24e",
    },
    "demo": {
        "2_init": "3d66477bd3b1032e",
        "3_rollouts": "f087643f1fc69414",
        "4_refine": "066482152bfeef99",
        "5_calibrate": "e6911e1542f05859",
        "6_targets": "838a75a02f54d689",
        "7_ridge": "84d8c09987814743",
        "8_finetune": "0cebe16068a45fda",
        "stage 1 fields": "43df89a1d93566ea",
    },
}


@pytest.mark.parametrize("name", ["default", "demo"])
def test_checkpoint_keys_are_those_written_before_the_groups(name):
    import hashlib
    import json

    from aloe_build.checkpoints import StageCheckpoints

    # settings added since, at the values that build as builds did then (chat positives were off by default)
    then = {"positives_chat_generic_systems": 0, "negatives_distracting": 0}
    if name == "default":
        then["positives_chat"] = False
    cfg = BuildConfig.preset(name, **then)
    ckpt = StageCheckpoints(None, "base", cfg)
    got = {stage: ckpt.key(stage) for stage in KEYS_BEFORE_GROUPS[name] if stage[0].isdigit()}
    got["stage 1 fields"] = hashlib.sha256(json.dumps(cfg.fields_of(1), sort_keys=True).encode()).hexdigest()[:16]
    assert got == KEYS_BEFORE_GROUPS[name]


def test_group_fields_are_given_flat_or_whole_and_written_flat():
    from aloe_build.config import ChatConfig

    flat = BuildConfig(positives_chat=True, chat_slots=True, refine_steps=7)
    whole = BuildConfig(chat=ChatConfig(positives_chat=True, chat_slots=True), refine_steps=7)
    assert flat == whole and flat.chat.chat_slots and flat.refine_steps == 7
    assert flat.to_dict()["chat_slots"] is True and "chat" not in flat.to_dict()
    assert BuildConfig.from_dict(flat.to_dict()) == flat
    # replace keeps the group and changes one of its fields
    assert dataclasses.replace(flat, negatives_chat_own=2).chat == ChatConfig(True, 400, 2, chat_slots=True)
    with pytest.raises(TypeError):
        BuildConfig(no_such_field=1)


def test_presets_set_their_fields_and_overrides_win():
    from aloe_build.presets import PRESETS

    assert BuildConfig.preset("default") == BuildConfig()
    demo = BuildConfig.preset("demo")
    assert (demo.encoder_records, demo.encoder_steps, demo.finetune_steps) == (1500, 600, 50)
    assert demo.chat.positives_chat and demo.chat.chat_slots
    assert BuildConfig.preset("quick", encoder_steps=5).encoder_steps == 5
    broad = BuildConfig.preset("broad")
    assert (broad.reading_decay, broad.experimental.positives_generated, broad.calibration_open_at) == (0.85, 6, 0.75)
    for name in PRESETS:
        BuildConfig.preset(name)
    with pytest.raises(ValueError, match="unknown preset 'fast'.*quick"):
        BuildConfig.preset("fast")


def test_chat_positives_follow_the_tokenizer_unless_set():
    class ChatTokenizer:
        chat_template = "{{ messages }}"

    class BaseTokenizer:
        chat_template = None

    auto = BuildConfig()
    assert auto.chat.positives_chat is None and BuildConfig(positives_chat="auto") == auto
    assert BuildConfig(positives_chat="False").chat.positives_chat is False
    assert BuildConfig(positives_chat="TRUE").chat.positives_chat is True
    assert auto.for_tokenizer(ChatTokenizer()).chat.positives_chat is True
    assert auto.for_tokenizer(BaseTokenizer()).chat.positives_chat is False
    assert auto.chat.positives_chat is None  # decided on a copy
    assert BuildConfig(positives_chat=False).for_tokenizer(ChatTokenizer()).chat.positives_chat is False
    with pytest.raises(ValueError, match="no chat template"):
        BuildConfig(positives_chat=True).for_tokenizer(BaseTokenizer())
    with pytest.raises(ValueError, match="chat_slots needs positives_chat"):
        BuildConfig(chat_slots=True).for_tokenizer(BaseTokenizer())
    with pytest.raises(ValueError, match="chat_slots needs positives_chat"):
        BuildConfig(chat_slots=True, positives_chat=False)
    with pytest.raises(ValueError, match="true, false or auto"):
        BuildConfig(positives_chat="yes")
    with pytest.raises(ValueError, match="positives_chat_generic_systems"):
        BuildConfig(positives_chat_generic_systems=1000)


def test_experimental_settings_and_unused_chat_settings_warn():
    with pytest.warns(UserWarning, match=r"experimental settings \['refine_pull'\]"):
        BuildConfig(refine_pull=0.3)
    with pytest.warns(UserWarning, match="no effect without positives_chat"):
        BuildConfig(negatives_chat_own=2, positives_chat=False)
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        BuildConfig.preset("demo")
        BuildConfig.preset("questions")
