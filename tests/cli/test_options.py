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


def test_a_mistyped_setting_is_one_line_before_any_work(capsys, tmp_path):
    """``aloe demo --set`` takes the demo preset's fields; a key that is no setting stops the command
    with one line naming it (exit 2), before the model loads or anything is written."""
    from aloe_cli.main import main

    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--set", "reading_decy=0.7"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("aloe demo: error: BuildConfig: unknown fields ['reading_decy']") and "Traceback" not in err
    assert not out.exists()
