"""``build`` part: time ``aloe build --device cuda --dtype bfloat16`` on 1,301 CounterFact
edits with a random-weight Llama of SmolLM2-135M's shape (a timing stand-in: the
real model's weights do not fit in what travels to the GPU machine).

Inputs come from ``scratch/`` (written by ``python -m benchmarks.gpu_suite
--prepare`` on a machine with ``../shared``): ``smollm2-tokenizer/`` (tokenizer and
config.json) and ``counterfact-val-1301.jsonl``. The CLI runs in a subprocess from
the source tree (nothing installed). Target: <= 3 minutes on an H100. If
``scratch/smollm2-135m-instruct/`` holds the real model, the build is also run on
it and its ``build_report.json`` (stage times, gate statistics) is kept; whether
the edits take is then a matter for ``aloe eval`` on that operator, which is kept
in the results folder (``smollm2_aloe_operator.safetensors``, ``smollm2_aloe_config.json``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .common import ROOT, SCRATCH, Context, PartResult, run_process

TOKENIZER_DIR = SCRATCH / "smollm2-tokenizer"
EDITS = SCRATCH / "counterfact-val-1301.jsonl"
REAL_MODEL = SCRATCH / "smollm2-135m-instruct"
TIMEOUT_S = 540  # one 10-minute device call, with room for the model save
# The CLI entry point, run from the source tree: aloe_vllm is mapped to integrations/vllm first.
CLI = (
    "import sys; from benchmarks.gpu.common import source_tree_imports; source_tree_imports(); "
    "from aloe_cli.main import main; sys.exit(main(sys.argv[1:]))"
)
OPERATOR_FILES = ("aloe_operator.safetensors", "aloe_config.json")
CONFIG_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def save_random_smollm2(out: Path, smoke: bool) -> Path:
    """A random-weight LlamaForCausalLM with SmolLM2-135M's config and tokenizer, saved to ``out``.

    The config is rebuilt from its size fields so that any transformers release
    reads it; ``smoke`` shrinks it to 2 layers.
    """
    import torch
    import transformers

    cfg = json.loads((TOKENIZER_DIR / "config.json").read_text())
    sizes = {k: cfg[k] for k in CONFIG_KEYS if k in cfg}
    if smoke:
        sizes.update(num_hidden_layers=2)
    config = transformers.LlamaConfig(**sizes)
    config._name_or_path = "random-smollm2-135m-shape"
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(out)
    for f in TOKENIZER_DIR.iterdir():
        if f.name != "config.json":
            (out / f.name).write_bytes(f.read_bytes())
    return out


def run_cli(args: list[str], timeout: float, extra_env: dict[str, str] | None = None, tail: int = 6000) -> tuple[int, str, float]:
    """``aloe <args>`` in a subprocess from the source tree: return code, the last ``tail`` characters of
    its output and seconds.

    ``extra_env`` overrides the environment (e.g. a PYTHONPATH that adds a package folder)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TQDM_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(extra_env or {})
    rc, text, seconds = run_process([sys.executable, "-c", CLI, *args], env, timeout)
    return rc, text[-tail:], seconds


def _flags_supported(res: PartResult) -> bool:
    """Whether ``aloe build --help`` lists --device and --dtype (the CLI is run, not imported: layering)."""
    rc, text, _ = run_cli(["build", "--help"], 120, tail=10**6)  # the usage lines lead a long list of settings
    ok = rc == 0 and "--device" in text and "--dtype" in text
    if not ok:
        res.log(f"`aloe build --help` (rc={rc}) does not list --device and --dtype: {text[-800:]}")
    return ok


def timed_build(
    ctx: Context, res: PartResult, model_dir: Path, label: str, limit: int | None, keep_as: str | None = None
) -> dict:
    """One ``aloe build`` on ``model_dir``: seconds, return code and the output's tail.

    ``keep_as``: copy the operator (``aloe_operator.safetensors``, ``aloe_config.json``)
    into the results folder under this prefix, so it can be evaluated elsewhere.
    """
    with tempfile.TemporaryDirectory(prefix="aloe-build-") as tmp:
        args = [
            "build",
            "--model",
            str(model_dir),
            "--edits",
            str(EDITS),
            "--out",
            str(Path(tmp) / "op"),
            "--device",
            ctx.device,
            "--dtype",
            "bfloat16" if ctx.cuda else "float32",
        ]
        if limit:
            args += ["--limit", str(limit)]
        rc, text, seconds = run_cli(args, TIMEOUT_S)
        report = {}
        for name in ("build_report.json", "report.json"):
            p = Path(tmp) / "op" / name
            if p.is_file():
                report = json.loads(p.read_text())
        if keep_as and rc == 0:
            ctx.out.mkdir(parents=True, exist_ok=True)
            for name in OPERATOR_FILES:
                shutil.copy(Path(tmp) / "op" / name, ctx.out / f"{keep_as}_{name}")
    row = {"model": label, "rc": rc, "seconds": seconds, "edits": limit or 1301, "output_tail": text[-3000:], "report": report}
    res.log(f"aloe build on {label} ({row['edits']} edits, --device {ctx.device}): rc={rc}, {seconds:.1f} s")
    if rc != 0:
        res.status = "fail"
        if "unrecognized arguments" in text:
            res.log("aloe build rejects --device/--dtype (unrecognized arguments)")
        res.log("build output (tail):\n" + text[-1500:])
    return row


def run(ctx: Context) -> PartResult:
    """The ``build`` part."""
    res = PartResult("build")
    missing = [str(p) for p in (TOKENIZER_DIR / "tokenizer.json", TOKENIZER_DIR / "config.json", EDITS) if not p.is_file()]
    if missing:
        res.status = "skipped"
        res.log(
            f"SKIP: {', '.join(missing)} missing; run `python -m benchmarks.gpu_suite --prepare` where "
            "../shared and the SmolLM2 tokenizer are present, before the GPU call"
        )
        return res
    if ctx.smoke:  # on a GPU the timed build itself shows whether the flags are taken
        if not _flags_supported(res):
            res.status = "fail"
            res.data["summary"] = "aloe build does not list --device/--dtype"
            return res
        res.log("SKIP the timed build in smoke mode: a build takes minutes on CPU; the CLI flags were checked")
        res.data["summary"] = "--device/--dtype listed by aloe build --help"
        return res
    with tempfile.TemporaryDirectory(prefix="aloe-random-smollm2-") as tmp:
        model_dir = save_random_smollm2(Path(tmp) / "model", ctx.smoke)
        row = timed_build(ctx, res, model_dir, "random-weight SmolLM2-135M shape", None)
    res.data["rows"] = [row]
    res.target(
        "aloe build of 1,301 edits --device cuda (minutes)", row["seconds"] / 60 if row["rc"] == 0 else None, "<=", 3.0, " min"
    )
    if (REAL_MODEL / "config.json").is_file():
        res.data["rows"].append(timed_build(ctx, res, REAL_MODEL, "SmolLM2-135M-Instruct (real)", None, keep_as="smollm2"))
    else:
        res.log(f"real SmolLM2 check not run: {REAL_MODEL} absent (its weights exceed what travels to the GPU)")
    if res.status == "ok" and any(t["verdict"] == "MISS" for t in res.targets):
        res.status = "miss"
    res.data["summary"] = f"random-shape build {row['seconds']:.0f} s (rc={row['rc']})"
    return res
