"""How ``aloe serve`` starts vLLM: the memory it gives it, and what it says when vLLM does not start.

No vLLM here: a stand-in server (a few lines of Python) plays its part, and the failures are
vLLM 0.32.0's own messages, as its CPU worker prints them.
"""

from __future__ import annotations

import io
import socket
import sys
import textwrap

import pytest

from aloe_vllm.format import AloeSpecError
from aloe_vllm.serve import served_name
from aloe_vllm.serve_memory import GIB, parse_size, plan_memory
from aloe_vllm.serve_process import ServerFailed, diagnose, run_server

MIB = 2**20


@pytest.mark.parametrize(
    "text, size",
    [("4G", 4 * GIB), ("4GiB", 4 * GIB), ("4gb", 4 * GIB), ("512M", 512 * MIB), ("1.5G", 3 * GIB // 2), ("2048", 2048)],
)
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "four", "4X", "-1G", "0"])
def test_parse_size_refuses(text):
    with pytest.raises(AloeSpecError, match="--memory"):
        parse_size(text)


@pytest.fixture
def model_dir(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * MIB)  # 1 MiB of weights
    (tmp_path / "config.json").write_text("{}")
    return tmp_path


def test_kv_cache_from_free_memory(model_dir):
    # 19 GiB free: a quarter of (19 - 1 MiB - 3 GiB) is just under 4 GiB
    plan = plan_memory(model_dir, None, [], {}, on_gpu=False, memory=(19 * GIB, 24 * GIB))
    assert plan.kv_bytes == (19 * GIB - MIB - 3 * GIB) // 4
    assert plan.vllm_args() == ["--kv-cache-memory-bytes", str(plan.kv_bytes)]
    assert "19.0 GiB free of 24.0 GiB" in plan.reason
    # plenty free: capped at 4 GiB; little free: at least 0.5 GiB
    assert plan_memory(model_dir, None, [], {}, on_gpu=False, memory=(100 * GIB, 128 * GIB)).kv_bytes == 4 * GIB
    assert plan_memory(model_dir, None, [], {}, on_gpu=False, memory=(4 * GIB, 24 * GIB)).kv_bytes == GIB // 2


def test_too_little_free_memory_says_what_to_change(model_dir):
    with pytest.raises(AloeSpecError, match=r"3\.2 GiB of 24\.0 GiB are free.*smaller --memory"):
        plan_memory(model_dir, None, [], {}, on_gpu=False, memory=(int(3.2 * GIB), 24 * GIB))
    with pytest.raises(AloeSpecError, match="KV cache 8.0 GiB"):
        plan_memory(model_dir, "8G", [], {}, on_gpu=False, memory=(10 * GIB, 24 * GIB))


def test_memory_option_and_vllm_own_settings(model_dir):
    free = (19 * GIB, 24 * GIB)
    assert plan_memory(model_dir, "1G", [], {}, on_gpu=False, memory=free).kv_bytes == GIB
    for args, env in (
        (["--gpu-memory-utilization", "0.3"], {}),
        (["--kv-cache-memory-bytes=1000000000"], {}),
        ([], {"VLLM_CPU_KVCACHE_SPACE": "2"}),
    ):
        plan = plan_memory(model_dir, None, args, env, on_gpu=False, memory=free)
        assert plan.kv_bytes is None and plan.vllm_args() == []
        with pytest.raises(AloeSpecError, match="give one of them"):
            plan_memory(model_dir, "1G", args, env, on_gpu=False, memory=free)


def test_gpu_keeps_vllm_defaults(model_dir):
    assert plan_memory(model_dir, None, [], {}, on_gpu=True, memory=(GIB, 24 * GIB)).vllm_args() == []
    assert plan_memory(model_dir, "2G", [], {}, on_gpu=True).vllm_args() == ["--kv-cache-memory-bytes", str(2 * GIB)]


def test_served_name(tmp_path):
    assert served_name("smollm2", []) == "smollm2"
    assert served_name(str(tmp_path), []) == tmp_path.name
    assert served_name("smollm2", ["--served-model-name", "mine"]) == "mine"
    assert served_name("smollm2", ["--served-model-name=mine"]) == "mine"


# vLLM 0.32.0's messages, as its CPU worker and API server print them
_VLLM_FAILURES = {
    "--gpu-memory-utilization": "(EngineCore pid=81) ERROR 12-06 02:55:56 [core.py:1100] ValueError: Available memory on "
    "node 0 (19.03/23.54 GiB) on startup is less than desired CPU memory utilization (0.92, 21.66 GiB).",
    "smaller --memory": "ValueError: Available memory on node 0 (1.10/23.54 GiB) on kv cache allocation is less than "
    "requested memory for kv (4.00 GiB). Decrease --kv-cache-memory-bytes, VLLM_CPU_KVCACHE_SPACE, or reduce CPU memory",
    "--max-model-len": "ValueError: To serve at least one request with the models's max seq len (131072), (16.00 GiB KV "
    "cache is needed, which is larger than the available KV cache memory (4.00 GiB).",
    "another --port": "OSError: [Errno 98] error while attempting to bind on address ('127.0.0.1', 8000): address already in use",
    "killed": "(EngineCore pid=4081) ERROR 12-06 02:59:58 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
    "unexpectedly (exit code: -9), shutting down executor.",
}


@pytest.mark.parametrize("advice", sorted(_VLLM_FAILURES))
def test_diagnose_known_failures(advice):
    assert advice in diagnose("INFO 12-06 02:55:34 [api_utils.py:347] starting\n" + _VLLM_FAILURES[advice] + "\n", 1)


def test_diagnose_other_failures():
    assert "killed" in diagnose("", -9)
    tail = "Traceback (most recent call last):\n  File 'x.py', line 1\nRuntimeError: Executor failed.\n"
    assert diagnose(tail, 1) == "vLLM stopped with RuntimeError: Executor failed."
    assert diagnose("nothing useful\n", 3) == "vLLM exited with code 3"


def _stand_in(tmp_path, body: str):
    script = tmp_path / "server.py"
    script.write_text(textwrap.dedent(body))
    return [sys.executable, str(script)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_failed_start_is_one_line_and_the_log_keeps_the_traceback(tmp_path):
    cmd = _stand_in(
        tmp_path,
        """
        import sys
        print("INFO 12-06 02:55:34 [api_utils.py:347] vLLM is starting", flush=True)
        print("Traceback (most recent call last):", flush=True)
        print('  File "launcher.py", line 9, in serve', flush=True)
        print("OSError: [Errno 98] error while attempting to bind on address: address already in use", flush=True)
        sys.exit(1)
        """,
    )
    shown, log = io.StringIO(), tmp_path / "logs" / "serve.log"
    with pytest.raises(ServerFailed) as failed:
        run_server(cmd, {}, f"http://127.0.0.1:{_port()}/health", log, lambda s: None, out=shown)
    assert "give another --port" in str(failed.value) and str(log) in str(failed.value)
    assert shown.getvalue() == "INFO 12-06 02:55:34 [api_utils.py:347] vLLM is starting\n"  # progress, no traceback
    assert "Traceback" in log.read_text() and "Errno 98" in log.read_text()


def test_ready_server_is_announced_and_passed_through(tmp_path):
    port = _port()
    cmd = _stand_in(
        tmp_path,
        f"""
        import http.server, os, time
        print("noise before the server answers", flush=True)
        class Health(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200)
                self.end_headers()
            def log_message(self, *args):
                print("request served", flush=True)
        server = http.server.HTTPServer(("127.0.0.1", {port}), Health)
        server.handle_request()  # /health once
        while not os.path.exists({str(tmp_path / "announced")!r}):  # run_server has called on_ready
            time.sleep(0.01)
        print("after ready", flush=True)
        """,
    )
    shown, ready = io.StringIO(), []

    def announce(seconds: float) -> None:
        ready.append(seconds)
        (tmp_path / "announced").touch()

    code = run_server(cmd, {}, f"http://127.0.0.1:{port}/health", tmp_path / "serve.log", announce, out=shown)
    assert code == 0 and len(ready) == 1 and ready[0] >= 0
    assert "noise before" not in shown.getvalue() and "after ready" in shown.getvalue()
    assert "noise before" in (tmp_path / "serve.log").read_text()
