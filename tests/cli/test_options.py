"""``--set KEY=VALUE``: JSON values where they parse, plain text otherwise."""

from __future__ import annotations

import argparse

from aloe_cli.options import config_overrides


def test_set_values_parse_as_json_or_stay_text():
    args = argparse.Namespace(
        config=None,
        set=[
            "refine_steps=5",
            "negatives_dtype=float32",
            "positives_chat=true",
            "compute_dtype=bfloat16",
            'chat_systems=["a", "b"]',
            "encoder_cache=null",
            "calibration_open_at=0.5",
            "layer=-1",
        ],
    )
    assert config_overrides(args) == {
        "refine_steps": 5,
        "negatives_dtype": "float32",
        "positives_chat": True,
        "compute_dtype": "bfloat16",
        "chat_systems": ["a", "b"],
        "encoder_cache": None,
        "calibration_open_at": 0.5,
        "layer": -1,
    }
