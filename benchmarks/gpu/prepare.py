"""``--prepare``: put into ``scratch/`` what the GPU machine cannot reach.

``../shared`` and ``~/.cache`` do not travel with the working tree; ``scratch/`` is
untracked and not ignored, so it does. Writes the SmolLM2 tokenizer and config
(a few MB), the first 1,301 CounterFact validation edits as ALOE JSONL, and a
copy of ``../shared/gpu/acceptance.py``. The real SmolLM2 (its 98 MB GGUF) exceeds
the 64 MiB a device call carries: ``prepare_model_parts`` splits it into three parts
under the ignored ``.gpu-model/`` for the ``smollm2`` part, one part per call.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .common import ROOT, SCRATCH

SHARED = ROOT.parent / "shared"
MODEL_CACHE = Path.home() / ".cache" / "aloe" / "models" / "smollm2-135m-instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json", "generation_config.json")
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
    done += prepare_model_parts()
    size = sum(p.stat().st_size for p in SCRATCH.rglob("*") if p.is_file())
    done.append(f"scratch/ holds {size / 2**20:.1f} MiB (a device call carries at most 64 MiB of working tree)")
    return done


def prepare_model_parts(out: Path | None = None) -> list[str]:
    """Split the installed SmolLM2 GGUF into ``.gpu-model/part1..3`` with its SHA-256 (part 1), the
    cached encoder of the default build settings (part 2, if trained here) and the ``gguf`` wheel
    (part 3, downloaded from the package index); return one line per item."""
    import importlib.metadata
    import subprocess
    import sys

    from aloe_build import BuildConfig, load_model
    from aloe_build.checkpoints import file_sha256
    from aloe_build.corpus import load_corpus
    from aloe_build.models import default_layer, smollm2_gguf_path
    from aloe_build.pipeline import encoder_cache_dir
    from aloe_kernels import weight_fingerprint
    from aloe_kernels.hf import locate_down_proj

    from .smollm2 import PARTS_DIR, SHA_FILE, split_file

    out = out or PARTS_DIR
    try:
        gguf = smollm2_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        return [f"MISSING the SmolLM2 GGUF ({exc}): the smollm2 part will wait for parts"]
    sha = file_sha256(gguf)
    done = []
    sha_path = out / "part1" / SHA_FILE
    if sha_path.is_file() and sha_path.read_text().split()[0] == sha:
        done.append(f"{out}/part1..3 already hold {gguf.name}")
    else:
        split_file(gguf, out)
        sha_path.write_text(f"{sha}  {gguf.name}\n")
        done.append(f"split {gguf} into {out}/part1..3 (SHA-256 {sha[:12]}...)")
    model, _ = load_model("smollm2", dtype="float32", device="cpu")
    cfg, layer = BuildConfig(), default_layer(model)
    fingerprint = weight_fingerprint(locate_down_proj(model, layer).weight())
    _, corpus_path = load_corpus(cfg.encoder_corpus, cfg.encoder_records, cfg.encoder_same_subject, cfg.seed)
    enc = encoder_cache_dir(cfg, fingerprint, layer, corpus_path)
    if (enc / "encoder.json").is_file():
        shutil.copytree(enc, out / "part2" / "encoders" / enc.name, dirs_exist_ok=True)
        done.append(f"copied the default encoder {enc} -> {out}/part2/encoders/")
    else:
        done.append(f"no cached encoder at {enc}: the GPU build will train it (build once here to cache it)")
    version = importlib.metadata.version("gguf")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(out / "part3"),
            f"gguf=={version}",
        ],
        capture_output=True,
        text=True,
    )
    done.append(
        f"gguf {version} wheel -> {out}/part3"
        if proc.returncode == 0
        else f"MISSING the gguf wheel (pip download failed: {proc.stderr.strip()[-300:]})"
    )
    return done
