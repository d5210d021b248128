"""The reference of every build setting, generated from :class:`aloe_build.BuildConfig`'s field
metadata: the epilog of ``aloe build --help`` and the "Every field" section of docs/options.md.

``python -m aloe_cli.settings_doc`` rewrites that section; a test checks it is up to date.
"""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from pathlib import Path

BEGIN, END = "<!-- fields:begin -->", "<!-- fields:end -->"
OPTIONS_MD = Path(__file__).resolve().parents[1] / "docs" / "options.md"


def _rows() -> list[tuple[str, str, int, str, str]]:
    """(group, name, stage, default, help) of every field, in stage order within each group."""
    from aloe_build.config import GROUPS, BuildConfig

    group_of = {f.name: g for g, cls in GROUPS.items() for f in dataclasses.fields(cls)}
    specs = sorted(
        BuildConfig.field_specs(),
        key=lambda f: (list(GROUPS).index(group_of[f.name]) + 1 if f.name in group_of else 0, f.metadata["stage"]),
    )
    return [
        (
            group_of.get(f.name, "core"),
            f.name,
            f.metadata["stage"],
            repr(f.default if f.default is not dataclasses.MISSING else f.default_factory()),
            f.metadata["help"],
        )
        for f in specs
    ]


def settings_text(width: int = 100) -> str:
    """Plain-text reference for ``aloe build --help``."""
    from aloe_build.config import STAGES
    from aloe_build.presets import PRESETS

    lines = ["presets (--preset NAME; --config and --set apply on top):"]
    lines += [f"  {name:10s} {what}" for name, (what, _) in PRESETS.items()]
    lines += ["", "settings (--set KEY=VALUE; values are JSON where they parse):"]
    group = None
    for g, name, stage, default, help_text in _rows():
        if g != group:
            group = g
            lines.append(f"  [{g}]")
        lines.append(f"  {name} = {default}  (stage {stage}: {STAGES.get(stage, 'every stage')})")
        lines += textwrap.wrap(help_text, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def settings_markdown() -> str:
    """The "Every field" tables of docs/options.md, one per group."""
    from aloe_build.config import STAGES

    out = []
    group = None
    for g, name, stage, default, help_text in _rows():
        if g != group:
            group = g
            title = {
                "core": "Core",
                "chat": "Chat (`BuildConfig.chat`)",
                "experimental": "Experimental (`BuildConfig.experimental`; setting one warns)",
            }[g]
            out += ["", f"### {title}", "", "| field | default | stage | what it does |", "|---|---|---|---|"]
        where = f"{stage} ({STAGES[stage]})" if stage else "all"
        out.append(f"| `{name}` | `{default}` | {where} | {help_text.replace('|', '/')} |")
    return "\n".join(out[1:])


def rewritten(text: str) -> str:
    """``text`` (docs/options.md) with the section between the markers regenerated."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise ValueError(f"docs/options.md needs the lines {BEGIN} and {END}")
    return f"{head}{BEGIN}\n{settings_markdown()}\n{END}{tail}"


def main() -> int:
    OPTIONS_MD.write_text(rewritten(OPTIONS_MD.read_text()))
    print(f"wrote {OPTIONS_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
