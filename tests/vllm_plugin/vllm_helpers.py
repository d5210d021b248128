"""Helpers of the vLLM integration tests (vLLM itself is imported only in the child process).

- :func:`save_tiny_model`: a tiny random Llama/Qwen2/Qwen3/Mistral saved as a
  Hugging Face directory vLLM's CPU backend accepts (head size 32, fp32).
- :func:`capture_down_proj_inputs`: the down_proj input h at the last token of
  each prompt, from a transformers model.
- :func:`make_edit_operator`: an operator whose edits open on given prompts and
  make given target tokens come out (addresses = normalised captured states,
  writes fitted by a few gradient steps on the patched transformers model).
- :func:`greedy_hf`: greedy continuations of a transformers model, the expected tokens.
- :func:`start_server`, :func:`wait_ready`, :func:`stop_server`, :func:`http_json`:
  the OpenAI-compatible server in a child process, and JSON requests to it.
- :func:`vllm_env`, :func:`run_vllm_generate`: greedy generation with ``vllm.LLM``
  in a child process that runs this file as a script (each configuration
  starts from a clean vLLM state).
"""

from __future__ import annotations

import contextlib
import copy
import os
from pathlib import Path
from typing import Iterator, Sequence

import torch

from aloe_kernels import AloeOperator, weight_fingerprint
from aloe_kernels.hf import apply_aloe, locate_down_proj, remove_aloe

__all__ = [
    "capture_down_proj_inputs",
    "SERVER_ARGS",
    "free_port",
    "greedy_hf",
    "http_json",
    "make_edit_operator",
    "run_vllm_generate",
    "save_tiny_model",
    "start_server",
    "start_user_server",
    "stop_server",
    "vllm_env",
    "wait_ready",
]


def save_tiny_model(out: str | os.PathLike, family: str = "llama", seed: int = 0, num_layers: int = 3, tokenizer=None) -> Path:
    """Save a tiny random causal LM (vLLM-compatible shapes) and a tokenizer to ``out``.

    hidden 64, 2 heads of 32 (vLLM's CPU attention needs head sizes >= 32),
    2 KV heads (divisible by TP=2), intermediate 96, vocab 128, fp32.
    """
    import transformers as tf

    if tokenizer is None:
        from tiny_models import tiny_tokenizer  # tests/ is on sys.path (tests/conftest.py's directory)

        tokenizer = tiny_tokenizer()
    cls = {"llama": tf.LlamaConfig, "qwen2": tf.Qwen2Config, "qwen3": tf.Qwen3Config, "mistral": tf.MistralConfig}[family]
    config = cls(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init with std 0.02 gives near-uniform logits; widen them so greedy
    # decoding has clear winners (fp rounding differences never flip a token).
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.eval()
    out = Path(out)
    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))
    return out


@torch.no_grad()
def capture_down_proj_inputs(model, tokenizer, prompts: Sequence[str], layer: int) -> torch.Tensor:
    """(len(prompts), d): the down_proj input at the last token of each prompt (fp32)."""
    site = locate_down_proj(model, layer)
    rows: list[torch.Tensor] = []

    def hook(_mod, args):
        rows.append(args[0][0, -1].detach().float().clone())

    handle = site.module.register_forward_pre_hook(hook)
    try:
        for p in prompts:
            ids = tokenizer(p, return_tensors="pt").input_ids
            model(input_ids=ids)
    finally:
        handle.remove()
    return torch.stack(rows)


def make_edit_operator(
    model,
    tokenizer,
    prompts: Sequence[str],
    targets: Sequence[str],
    layer: int,
    *,
    steps: int = 25,
    lr: float = 0.5,
    threshold: float = 0.9,
    temperature: float = 40.0,
    extra_open: Sequence[Sequence[str]] | None = None,
) -> AloeOperator:
    """An operator with one edit per (prompt, target): opens at the prompt's last token, emits the target.

    addresses: normalised last-token down_proj inputs (averaged with those of
    ``extra_open[i]``, e.g. rephrases, which then open edit i too); thresholds
    ``threshold``, lowered below the lowest score among an edit's own prompts;
    writes: ``steps`` Adam steps maximising the log-probability of the target's
    first token at each of the edit's prompts on the patched transformers
    model. Only the last token is re-run each step (the earlier tokens' KV
    cache is computed once), so this is cheap even for SmolLM2 on a CPU.
    """
    n = len(prompts)
    extra_open = [list(e) for e in (extra_open or [[] for _ in range(n)])]
    site = locate_down_proj(model, layer)
    d_out = site.d_out
    h = torch.nn.functional.normalize(capture_down_proj_inputs(model, tokenizer, prompts, layer), dim=1)
    addresses = h.clone()
    thresholds = torch.full((n,), float(threshold))
    for i, extra in enumerate(extra_open):
        if extra:
            he = torch.nn.functional.normalize(capture_down_proj_inputs(model, tokenizer, extra, layer), dim=1)
            own = torch.cat([h[i : i + 1], he])
            a = torch.nn.functional.normalize(own.mean(0), dim=0)
            addresses[i] = a
            thresholds[i] = min(float(threshold), float((own @ a).min()) - 0.02)
    target_ids = [
        tokenizer(" " + t.lstrip() if not t.startswith(" ") else t, add_special_tokens=False).input_ids[0] for t in targets
    ]
    fp = weight_fingerprint(site.weight())
    edits = [{"id": f"edit-{i}", "request": p, "target": t, "subject": None} for i, (p, t) in enumerate(zip(prompts, targets))]
    temps = torch.full((n,), float(temperature))
    writes = torch.zeros(n, d_out, requires_grad=True)
    shell = AloeOperator(
        addresses=addresses,
        thresholds=thresholds,
        temperatures=temps,
        writes=torch.zeros(n, d_out),
        layer=layer,
        weight_fingerprint=fp,
        edits=edits,
    )
    # One left-padded batch of every prompt an edit must fire on; the prefix KV
    # cache is computed once (the write only changes the last token's stream).
    texts, tids = [], []
    for i in range(n):
        for p in [prompts[i], *extra_open[i]]:
            texts.append(p)
            tids.append(target_ids[i])
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        enc = tokenizer(texts, return_tensors="pt", padding=True)
    finally:
        tokenizer.padding_side = side
    ids, mask = enc.input_ids, enc.attention_mask
    if int(mask.sum(1).min()) < 2:
        raise ValueError("every prompt must have at least two tokens")
    pos = (mask.cumsum(1) - 1).clamp_min(0)
    with torch.no_grad():
        past = model(input_ids=ids[:, :-1], attention_mask=mask[:, :-1], position_ids=pos[:, :-1], use_cache=True).past_key_values
    tids_t = torch.tensor(tids)
    wrapper = apply_aloe(model, shell, layer)
    opt = torch.optim.Adam([writes], lr=lr)
    try:
        wrapper.writes = writes  # the wrapper reads this tensor at call time; grads flow into it
        for _ in range(steps):
            opt.zero_grad()
            with torch.enable_grad():
                cache = copy.deepcopy(past)  # the forward appends to the cache
                logits = (
                    model(
                        input_ids=ids[:, -1:],
                        attention_mask=mask,
                        position_ids=pos[:, -1:],
                        past_key_values=cache,
                        use_cache=True,
                    )
                    .logits[:, -1]
                    .float()
                )
                loss = -torch.log_softmax(logits, -1).gather(1, tids_t[:, None]).sum()
            loss.backward()
            opt.step()
    finally:
        remove_aloe(model)
    name = getattr(getattr(model, "config", None), "_name_or_path", None) or None
    return AloeOperator(
        addresses=addresses,
        thresholds=thresholds,
        temperatures=temps,
        writes=writes.detach().clone(),
        layer=layer,
        weight_fingerprint=fp,
        base_model=name,
        edits=edits,
    )


@contextlib.contextmanager
def cpu_path() -> Iterator[None]:
    """Run the patched transformers model on ALOE's PyTorch CPU path (TRITON_INTERPRET=0), restoring after.

    The test session sets TRITON_INTERPRET=1 for the kernel tests; the interpreter is far too
    slow for SmolLM2 generation or fitting.
    """
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


@torch.no_grad()
def greedy_hf(model, tokenizer, prompts: Sequence[str], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuation token ids, one prompt at a time (no padding effects)."""
    out = []
    for p in prompts:
        ids = tokenizer(p, return_tensors="pt").input_ids
        cur = ids
        toks: list[int] = []
        past = None
        step_in = cur
        for _ in range(max_new_tokens):
            res = model(input_ids=step_in, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            toks.append(nxt)
            if tokenizer.eos_token_id is not None and nxt == tokenizer.eos_token_id:
                break
            step_in = torch.tensor([[nxt]])
        out.append(toks)
    return out


# --------------------------------------------------------------------------- the OpenAI-compatible server

#: Server options of the tests: fp32 (the expected tokens come from fp32 transformers), short context, eager.
SERVER_ARGS = ("--dtype", "float32", "--max-model-len", "256", "--enforce-eager")


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_json(method: str, url: str, body: dict | None = None, key: str | None = None, timeout: float = 300) -> tuple[int, dict]:
    """``(status, JSON body)`` of one request; 4xx/5xx answers are returned, not raised."""
    import json
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        raw = exc.read()
        try:
            return exc.code, json.loads(raw)
        except ValueError:
            return exc.code, {"raw": raw.decode(errors="replace")}


def start_server(cmd: Sequence[str], log: Path, **env: str):
    """Start a server command (its output to ``log``), with the CPU vLLM environment plus ``env``."""
    import subprocess

    full_env = vllm_env(1, **env)
    full_env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server runs its engine core in a child
    return subprocess.Popen(list(cmd), env=full_env, stdout=log.open("w"), stderr=subprocess.STDOUT)


#: what the test harness sets in its own environment (Makefile, .ci/run, tests/conftest.py, vllm_env): a user's
#: shell has none of them, so a server started "as a user would" runs without them
HARNESS_ENV = (
    "TRITON_INTERPRET",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TQDM_DISABLE",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
    "VLLM_CPU_KVCACHE_SPACE",
    "ALOE_VLLM_SCREEN",
)


def start_user_server(cmd: Sequence[str], log: Path, **env: str):
    """Start a server command (its output to ``log``) in a user's environment: this process's without
    :data:`HARNESS_ENV`, plus ``env``."""
    import subprocess

    full_env = {k: v for k, v in os.environ.items() if k not in HARNESS_ENV}
    full_env.update(env)
    return subprocess.Popen(list(cmd), env=full_env, stdout=log.open("w"), stderr=subprocess.STDOUT)


def wait_ready(proc, port: int, log: Path, timeout: float = 600) -> None:
    """Wait until ``/health`` answers 200; AssertionError with the log's tail if the server exits or times out."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise AssertionError(f"server not ready after {timeout}s:\n{log.read_text()[-4000:]}")


def stop_server(proc) -> None:
    """Terminate a server started by :func:`start_server` (kill it after 60 s)."""
    import subprocess

    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# --------------------------------------------------------------------------- vLLM runs in a child process


def vllm_env(tp: int = 1, cache_root: str | None = None, **extra: str) -> dict[str, str]:
    """Environment for running vLLM on CPU in a child process (see :func:`run_vllm_generate`)."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # The CPU serving path (sparse PyTorch) unless a run asks for the Triton interpreter.
    env["TRITON_INTERPRET"] = "0"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    if tp == 1:
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(str(i) for i in range(tp)))
    if cache_root:
        env["VLLM_CACHE_ROOT"] = str(cache_root)
    # Worker processes import test-only worker extensions (faulty_worker) from this folder.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).parent), env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_vllm_generate(
    runs: list[dict],
    *,
    tp: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 900,
    workdir: str | os.PathLike | None = None,
) -> list[list[list[int]]]:
    """Greedy generation with ``vllm.LLM`` in a child process; one result list per run.

    Each run is ``{"model": dir, "prompts": [...], "max_tokens": n, "eager": bool}``, or has
    ``"prompt_token_ids": [[...], ...]`` instead of ``"prompts"`` (then vLLM loads no tokenizer),
    and optionally ``"env": {...}`` applied before the run (e.g. ``TRITON_INTERPRET``), ``"llm": {...}``
    more ``vllm.LLM`` arguments (``block_size``, ``enable_prefix_caching``, ...), ``"sequential": true``
    (one ``generate`` call per prompt, in order, so later prompts can find earlier ones' blocks in
    the prefix cache) and
    ``"swaps": [operator_dir, ...]``: generate, then for each directory swap it in with
    ``aloe_vllm.swap.swap_operator`` and generate again (the run's result is then one list per phase).
    With ``"pointers": true`` the result is ``{"tokens": ..., "pointers": [...]}``: after each phase,
    every rank's ``data_ptr`` of the ALOE parameters. With ``"swap_errors": true`` a failed swap is
    recorded instead of raised: ``{"tokens", "errors" (per swap, None when it worked), "infos" (every
    rank's ``aloe_operator_info`` after each phase)}``. ``"extension"`` names another worker extension
    class (importable from this folder, which is on the workers' ``PYTHONPATH``).
    Runs execute one after another in the same child (each LLM is torn down
    before the next). Raises RuntimeError with the child's output tail on failure.
    """
    import json
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        spec = Path(tmp) / "runs.json"
        out = Path(tmp) / "out.json"
        spec.write_text(json.dumps({"runs": runs, "tp": tp}))
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).resolve()), str(spec), str(out)],
            env=env if env is not None else vllm_env(tp),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0 or not out.is_file():
            tail = (proc.stdout + proc.stderr)[-6000:]
            raise RuntimeError(f"vLLM child failed (rc={proc.returncode}):\n{tail}")
        return json.loads(out.read_text())["results"]


def _aloe_storage(worker) -> dict[str, int]:
    """On a worker: where the ALOE layer's parameters live (``data_ptr``), to see that swaps copy in place."""
    from aloe_vllm.format import PARAM_NAMES

    layer = worker._aloe_layer()
    return {name: getattr(layer, name).data_ptr() for name in PARAM_NAMES}


def _child_main(spec_path: str, out_path: str) -> None:
    import gc
    import json

    from vllm import LLM, SamplingParams
    from vllm.distributed import cleanup_dist_env_and_memory

    from aloe_vllm.swap import EXTENSION, swap_operator

    spec = json.loads(Path(spec_path).read_text())
    results = []
    for run in spec["runs"]:
        os.environ.update(run.get("env", {}))  # read at call time (TRITON_INTERPRET) or by spawned workers
        token_ids = run.get("prompt_token_ids")
        llm = LLM(
            model=run["model"],
            dtype=run.get("dtype", "float32"),
            enforce_eager=bool(run.get("eager", True)),
            max_model_len=int(run.get("max_model_len", 256)),
            seed=0,
            tensor_parallel_size=int(spec.get("tp", 1)),
            skip_tokenizer_init=token_ids is not None,
            worker_extension_cls=run.get("extension", EXTENSION) if "swaps" in run else "",
            **run.get("llm", {}),
        )
        params = SamplingParams(
            temperature=0.0, max_tokens=int(run["max_tokens"]), ignore_eos=False, detokenize=token_ids is None
        )
        prompts = [{"prompt_token_ids": ids} for ids in token_ids] if token_ids is not None else run["prompts"]
        phases, pointers, infos, errors = [], [], [], []
        for swap in [None, *run.get("swaps", [])]:
            if swap is not None:
                try:
                    swap_operator(llm, swap)
                    errors.append(None)
                except Exception as exc:  # recorded when the run asks for it: the test expects a refusal
                    if not run.get("swap_errors"):
                        raise
                    errors.append(f"{type(exc).__name__}: {exc}")
            batches = [[p] for p in prompts] if run.get("sequential") else [prompts]
            outs = [o for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]
            phases.append([list(o.outputs[0].token_ids) for o in outs])
            if run.get("pointers"):
                pointers.append(llm.collective_rpc(_aloe_storage))
            if run.get("swap_errors"):
                infos.append(llm.collective_rpc("aloe_operator_info"))
        result = phases if "swaps" in run else phases[0]
        if run.get("pointers"):
            result = {"tokens": result, "pointers": pointers}
        if run.get("swap_errors"):
            result = {"tokens": result, "errors": errors, "infos": infos}
        results.append(result)
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()
    Path(out_path).write_text(json.dumps({"results": results}))


if __name__ == "__main__":
    import sys

    _child_main(sys.argv[1], sys.argv[2])
