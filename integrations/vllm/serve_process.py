"""The vLLM server as a child of ``aloe serve``: started, watched until it answers, stopped with it.

Everything vLLM prints goes to a log file. Until the server answers ``/health``, the terminal
gets vLLM's log lines (INFO and WARNING: its progress) but not its tracebacks; if vLLM stops
before it serves, :func:`diagnose` turns the end of its output into one line that says what to
change, and the log keeps the rest. Once it serves, everything vLLM prints is passed through.
SIGINT, SIGTERM and SIGHUP are passed on to vLLM, and vLLM is stopped if ``aloe serve`` dies.
"""

from __future__ import annotations

import collections
import ctypes
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Sequence, TextIO

#: vLLM's log lines (``(EngineCore pid=12) INFO 12-06 02:55:56 [core.py:133] ...``) shown while it starts
_PROGRESS_LINE = re.compile(r"^(\(\S+ pid=\d+\) )?(INFO|WARNING) \d")
#: the last lines of vLLM's output kept to explain a failed start
_TAIL_LINES = 400
_PR_SET_PDEATHSIG = 1

#: what to change when a vLLM process was killed (SIGKILL), most often by the kernel's out-of-memory killer
_KILLED = "a vLLM process was killed, most often by the kernel when memory runs out: free memory or give a smaller --memory"
#: (pattern in vLLM's output, what to change): the known reasons vLLM stops before it serves
_KNOWN_FAILURES: tuple[tuple[str, str], ...] = (
    (
        r"less than desired CPU memory utilization",
        "vLLM's --gpu-memory-utilization asks for more CPU memory than is free: drop it, and aloe serve "
        "sizes the KV cache from free memory (or set it with --memory)",
    ),
    (
        r"on kv cache\s+allocation is less than requested memory",
        "the KV cache does not fit in free memory: free memory or give a smaller --memory",
    ),
    (
        r"larger than the available KV cache memory|max seq len",
        "the KV cache is too small for the model's context: give a larger --memory, or a shorter context "
        "after --: -- --max-model-len 4096",
    ),
    (r"Address already in use|Errno 98", "the port is taken: give another --port"),
    (r"No module named 'vllm'", "vLLM is not installed in this Python: run aloe serve from .venv-vllm (make install-vllm)"),
    (r"died unexpectedly \(exit code: -9\)", _KILLED),
)


def diagnose(tail: str, returncode: int | None) -> str:
    """What to change, from the end of vLLM's output and its exit code, in one line."""
    for pattern, advice in _KNOWN_FAILURES:
        if re.search(pattern, tail):
            return advice
    if returncode is not None and returncode < 0:
        name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else str(-returncode)
        if -returncode == signal.SIGKILL:
            return _KILLED
        return f"vLLM was stopped by {name}"
    errors = re.findall(r"^(?:\(\S+ pid=\d+\) )?(?:ERROR [^\]]*\] )?(\w+(?:Error|Exception): .+)$", tail, re.MULTILINE)
    if errors:
        return f"vLLM stopped with {errors[-1].strip()[:300]}"
    return f"vLLM exited with code {returncode}"


def _stop_with_parent() -> None:
    """In the child before exec: receive SIGTERM when the parent dies (Linux), so no server is orphaned."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


class ServerFailed(RuntimeError):
    """vLLM stopped before it served; the message says what to change."""


def run_server(
    cmd: Sequence[str],
    env: dict[str, str],
    health_url: str,
    log_path: Path,
    on_ready: Callable[[float], None],
    out: TextIO = sys.stderr,
    verbose: bool = False,
) -> int:
    """Run the server ``cmd`` until it exits; returns its exit code once it has served.

    ``on_ready(seconds)`` is called when ``health_url`` first answers 200. Raises
    :class:`ServerFailed` (with :func:`diagnose`'s line and the log's path) if the server exits
    before that, unless it was asked to stop. ``verbose``: show everything vLLM prints from the start."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    start = time.monotonic()
    ready = threading.Event()
    tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
    proc = subprocess.Popen(
        list(cmd),
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        bufsize=1,
        start_new_session=True,  # a Ctrl-C reaches vLLM once, from here, not twice
        preexec_fn=_stop_with_parent if sys.platform.startswith("linux") else None,
    )

    def relay() -> None:
        with log_path.open("w") as log:
            for line in proc.stdout:  # type: ignore[union-attr]
                log.write(line)
                log.flush()
                tail.append(line)
                if verbose or ready.is_set() or _PROGRESS_LINE.match(line):
                    out.write(line)
                    out.flush()

    reader = threading.Thread(target=relay, daemon=True)
    reader.start()
    stopped: list[int] = []

    def pass_on(sig: int, _frame) -> None:
        stopped.append(sig)
        proc.send_signal(sig)

    previous = {sig: signal.signal(sig, pass_on) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        while proc.poll() is None and not ready.is_set():
            if _answers(health_url):
                ready.set()
                on_ready(time.monotonic() - start)
            else:
                time.sleep(0.5)
        code = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if proc.poll() is None:
            proc.kill()
        reader.join(timeout=10)
    if not ready.is_set() and not stopped:
        raise ServerFailed(f"vLLM stopped before serving: {diagnose(''.join(tail), code)} (vLLM's output: {log_path})")
    return code
