"""The settings reference is generated from BuildConfig's metadata, and docs/options.md holds the
current one (``python -m aloe_cli.settings_doc`` rewrites it)."""

from __future__ import annotations

import subprocess
import sys

from aloe_build.config import BuildConfig
from aloe_cli.settings_doc import OPTIONS_MD, rewritten, settings_markdown, settings_text


def test_every_field_is_in_the_help_and_the_docs_table():
    text, table = settings_text(), settings_markdown()
    for f in BuildConfig.field_specs():
        assert f"  {f.name} = " in text, f.name
        assert f"| `{f.name}` |" in table, f.name
    assert "demo" in text and "quick" in text


def test_docs_options_md_is_up_to_date():
    current = OPTIONS_MD.read_text()
    assert rewritten(current) == current, "run: python -m aloe_cli.settings_doc"


def test_build_help_lists_presets_and_settings():
    out = subprocess.run([sys.executable, "-m", "aloe_cli", "build", "--help"], capture_output=True, text=True, check=True).stdout
    assert "--preset {default,quick,demo,questions,chat,broad,large}" in out.replace("\n", " ").replace("  ", " ")
    assert "refine_steps = 3000" in out
