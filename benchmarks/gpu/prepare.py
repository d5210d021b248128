"""``--prepare``: put into ``scratch/`` what the GPU machine cannot reach.

``../shared`` and ``~/.cache`` do not travel with the working tree; ``scratch/`` is
untracked and not ignored, so it does. Writes the SmolLM2 tokenizer and config
(a few MB), the first 1,301 CounterFact validation edits as ALOE JSONL, and a
copy of ``../shared/gpu/acceptance.py``. The real SmolLM2 weights (~540 MB in
float32) exceed the 64 MiB a device call carries, so they are not copied.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .common import ROOT, SCRATCH

SHARED = ROOT.parent / "shared"
MODEL_CACHE = Path.home() / ".cache" / "aloe" / "models" / "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json",
                   "generation_config.json")
N_EDITS = 1301


def prepare(model_dir: Path = MODEL_CACHE, shared: Path = SHARED) -> list[str]:
    """Copy the inputs into ``scratch/``; return one line per item (done or why not)."""
    from benchmarks.gpu.build import EDITS, TOKENIZER_DIR

    SCRATCH.mkdir(exist_ok=True)
    done = []
    src = shared / "gpu" / "acceptance.py"
    if src.is_file():
        shutil.copyfile(src, SCRATCH / "acceptance.py")
        done.append(f"copied {src} -> {SCRATCH / 'acceptance.py'}")
    else:
        done.append(f"MISSING {src}: the acceptance part will be skipped")
    if (model_dir / "tokenizer.json").is_file():
        TOKENIZER_DIR.mkdir(exist_ok=True)
        for name in TOKENIZER_FILES:
            if (model_dir / name).is_file():
                shutil.copyfile(model_dir / name, TOKENIZER_DIR / name)
        cfg_path = TOKENIZER_DIR / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        # transformers 5 writes its own class name; 4.x knows only PreTrainedTokenizerFast (5.x reads both)
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        cfg_path.write_text(json.dumps(cfg, indent=1))
        done.append(f"copied the SmolLM2 tokenizer and config from {model_dir} -> {TOKENIZER_DIR}")
    else:
        done.append(f"MISSING {model_dir}/tokenizer.json: the build part will be skipped")
    edits = shared / "data" / "counterfact" / "counterfact-val.json"
    if edits.is_file():
        from aloe_build import load_edits, save_edits_jsonl

        save_edits_jsonl(load_edits(edits, limit=N_EDITS), EDITS)
        done.append(f"wrote the first {N_EDITS} edits of {edits} -> {EDITS}")
    else:
        done.append(f"MISSING {edits}: the build part will be skipped")
    size = sum(p.stat().st_size for p in SCRATCH.rglob("*") if p.is_file())
    done.append(f"scratch/ holds {size / 2**20:.1f} MiB (a device call carries at most 64 MiB of working tree)")
    return done
