"""Named build settings (``aloe build --preset NAME``, :meth:`BuildConfig.preset`).

Each preset is a set of field overrides on the defaults, with what it is for; the measured effect
of each is in docs/options.md.
"""

from __future__ import annotations

from typing import Any

#: name -> (what it is for, the fields it sets)
PRESETS: dict[str, tuple[str, dict[str, Any]]] = {
    "default": ("the paper's settings, and edits that fire in chat when the model has a chat template", {}),
    "quick": (
        "a few facts in minutes on a CPU, to try the tool (a short encoder and small negative pools)",
        {
            "encoder_records": 300,
            "encoder_steps": 150,
            "negative_pool_records": 100,
            "negatives_chat_pool": 100,
            "negatives_chat_questions": 100,
            "negatives_distracting": 100,
            "negatives_chat_systems": 8,
        },
    ),
    "demo": (
        "what `make demo` runs: a mid-size encoder, edits that fire in chat, one chat slot per edit",
        {"encoder_records": 1500, "encoder_steps": 600, "finetune_steps": 50, "positives_chat": True, "chat_slots": True},
    ),
    "questions": (
        "a stream of questions (zsRE-like): gates that open nearer the negatives, for rewordings",
        {"calibration_open_at": 0.5, "calibration_negative_slack": 6.0},
    ),
    "chat": (
        "a served chat model: edits fire through the chat template, each in a slot of its own",
        {"positives_chat": True, "chat_slots": True, "calibration_negative_slack": 6.0},
    ),
    "broad": (
        "facts asked in other words or after other text: a running reading, relation templates, "
        "rewordings the model writes and the request after other text as positives, gates opened "
        "three quarters of the way to them",
        {
            "reading_decay": 0.85,
            "positives_same_relation": 8,
            "positives_generated": 6,
            "positives_prefixed": 8,
            "positives_prefixed_prose": 8,
            "positives_prefixed_written": 4,
            "negatives_after_statement": 4,
            "calibration_open_at": 0.75,
            "calibration_negative_slack": 6.0,
        },
    ),
    "large": (
        "thousands of edits: each gate's edge further above its worst negative, for locality",
        {"calibration_negative_slack": 6.0},
    ),
}


def preset_fields(name: str) -> dict[str, Any]:
    """The fields ``name`` sets; a ValueError naming the presets if there is none of that name."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    return dict(PRESETS[name][1])
