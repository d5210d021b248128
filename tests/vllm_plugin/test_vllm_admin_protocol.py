"""The live-swap endpoint's protocol, without a server: ``AloeAdminMiddleware`` driving real
``AloeWorkerExtension`` objects through an engine stand-in whose ``collective_rpc`` calls them in turn.

The layer is a recorder (its ``aloe_swap_`` can be made to fail), so these tests check what the
endpoint answers and which RPCs it makes: where it reads operators from, the check before any
tensor is read, one swap at a time across API processes, the staging slots released on every
path, the prefix cache reset after a commit, and answers that say what serves after a failure.
The served model itself is exercised in test_vllm_admin.py.
"""

from __future__ import annotations

import asyncio
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm  # make test-vllm runs these in .venv-vllm
pytest.importorskip("vllm")

from helpers import random_operator  # noqa: E402

from aloe_kernels import AloeOperator  # noqa: E402
from aloe_vllm.admin import ROUTE, AloeAdminMiddleware  # noqa: E402
from aloe_vllm.format import ADMIN_KEY_ENV, ADMIN_ROOT_ENV, AloeSpec, AloeSwapFailed  # noqa: E402
from aloe_vllm.worker import AloeWorkerExtension  # noqa: E402

KEY = "protocol-test-key-0123"
D, D_OUT, SLOTS = 16, 8, 4
FINGERPRINT = "sha256-bf16:" + "1" * 32


class FakeLayer:
    """What the worker needs of ``AloeRowParallelLinear``: the spec, swaps (recorded, undoable) and the live info."""

    def __init__(self) -> None:
        self.aloe_spec = AloeSpec(layer=1, n=0, d=D, d_out=D_OUT, eps=1e-6, gate_eps=1e-3, capacity=SLOTS)
        self.live = {"n": 0, "capacity": SLOTS, "operator_hash": "start", "loaded_at": 0.0}
        self.fail_next = False

    @property
    def aloe_operator_hash(self) -> str:
        return self.live["operator_hash"]

    def aloe_swap_(self, op: AloeOperator, digest: str) -> dict:
        if self.fail_next:  # the real layer restores its rows before raising
            self.fail_next = False
            raise AloeSwapFailed(f"write failed; the previous operator {self.live['operator_hash']} is live again")
        before, self.live = dict(self.live), {**self.live, "n": op.n, "operator_hash": digest, "loaded_at": 1.0}
        return before

    def aloe_undo_(self, before: dict) -> None:
        self.live = before

    def aloe_info(self) -> dict:
        return dict(self.live)


class Worker(AloeWorkerExtension):
    """A rank: the real worker methods on a fake layer; its commit agreement meets the other ranks'
    at a barrier, as the real one meets them in an all-reduce."""

    def __init__(self, barrier: threading.Barrier, votes: list) -> None:
        self.layer, self.barrier, self.votes = FakeLayer(), barrier, votes

    def _aloe_layer(self):
        return self.layer

    def _aloe_all_ranks_ok(self, ok: bool) -> bool:
        self.votes.append(ok)
        self.barrier.wait(timeout=10)
        return all(self.votes)


class Engine:
    """``collective_rpc`` runs the method on every rank at once (threads, like the workers' processes)
    and returns when all are done, as the engine does between two steps; ``reset_prefix_cache`` is
    recorded."""

    def __init__(self, ranks: int = 2, data_parallel: int = 1) -> None:
        self.votes: list = []
        barrier = threading.Barrier(ranks, action=lambda: None)
        self.workers = [Worker(barrier, self.votes) for _ in range(ranks)]
        self.calls: list[str] = []
        self.resets: list[bool] = []
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=data_parallel))

    async def collective_rpc(self, method: str, args: tuple = ()) -> list:
        self.calls.append(method)
        self.votes.clear()
        with ThreadPoolExecutor(len(self.workers)) as pool:
            futures = [pool.submit(getattr(w, method), *args) for w in self.workers]
            errors = [f.exception() for f in futures]
        await asyncio.sleep(0.01)  # the staging threads run meanwhile
        if any(errors):
            raise next(e for e in errors if e)
        return [f.result() for f in futures]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.resets.append(reset_running_requests)
        return True


def call(mw: AloeAdminMiddleware, engine: Engine, method: str, body: dict | None = None, key: str = KEY) -> tuple[int, dict]:
    """One request through the middleware: (status, JSON body)."""
    raw = json.dumps(body).encode() if body is not None else b""
    scope = {
        "type": "http",
        "method": method,
        "path": ROUTE,
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {key}".encode())],
        "app": SimpleNamespace(state=SimpleNamespace(engine_client=engine)),
    }
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    async def send(message):
        sent.append(message)

    async def passthrough(scope, receive, send):
        raise AssertionError("the middleware passed its own path on")

    mw.app = passthrough
    asyncio.run(mw(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    payload = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, json.loads(payload)


@pytest.fixture
def served(tmp_path, monkeypatch):
    """A middleware reading operators under ``tmp_path/ops``, an engine of two ranks, and operators."""
    root = tmp_path / "ops"
    root.mkdir()
    monkeypatch.setenv(ADMIN_KEY_ENV, KEY)
    monkeypatch.setenv(ADMIN_ROOT_ENV, str(root))
    ops = {}
    for name, n in (("a", 2), ("b", 3), ("too-many", SLOTS + 1)):
        op = random_operator(n, D, D_OUT, seed=n, weight_fingerprint=FINGERPRINT, layer=1, eps=1e-6, gate_eps=1e-3)
        ops[name] = op.save(root / name)
    return SimpleNamespace(mw=AloeAdminMiddleware(None), engine=Engine(), root=root, ops=ops, outside=tmp_path)


def _hash(path) -> str:
    return AloeOperator.load(path).fingerprint()


def test_swap_commits_on_every_rank_and_resets_the_prefix_cache(served):
    status, out = call(served.mw, served.engine, "POST", {"path": str(served.ops["a"])})
    assert status == 200, out
    assert (out["n"], out["operator_hash"], out["ranks"], out["prefix_cache_reset"]) == (2, _hash(served.ops["a"]), 2, True)
    assert all(w.layer.live["operator_hash"] == out["operator_hash"] for w in served.engine.workers)
    assert served.engine.resets == [True]  # running requests recomputed too
    assert served.engine.calls[-1] == "aloe_release"
    assert all(getattr(w, "_aloe_staging", None) is None for w in served.engine.workers)
    keys = ("n", "capacity", "operator_hash", "loaded_at", "ranks", "rank_hashes")
    assert call(served.mw, served.engine, "GET") == (200, {k: out[k] for k in keys})


def test_paths_outside_the_root_are_refused_before_any_rpc(served, monkeypatch):
    elsewhere = served.outside / "elsewhere"
    AloeOperator.load(served.ops["a"]).save(elsewhere / "a")
    (served.root / "escape").symlink_to(elsewhere)
    for path in (str(elsewhere / "a"), str(served.root / ".." / "elsewhere" / "a"), str(served.root / "escape" / "a")):
        status, out = call(served.mw, served.engine, "POST", {"path": path})
        assert status == 403 and "operators are read only from under" in out["error"], (path, out)
    monkeypatch.delenv(ADMIN_ROOT_ENV)
    status, out = call(AloeAdminMiddleware(None), served.engine, "POST", {"path": str(served.ops["a"])})
    assert status == 403 and ADMIN_ROOT_ENV in out["error"]
    assert served.engine.calls == []


def test_oversized_operator_refused_before_it_is_read(served, monkeypatch):
    """n past the capacity, header shapes other than the config's, or a tensor file larger than its
    config's shapes: 422, and no tensor loaded."""

    def no_load(*args, **kwargs):
        raise AssertionError("the tensors were read")

    monkeypatch.setattr(AloeOperator, "load", no_load)
    status, out = call(served.mw, served.engine, "POST", {"path": str(served.ops["too-many"])})
    assert status == 422 and f"capacity of {SLOTS}" in out["error"], out
    from safetensors.torch import load_file, save_file

    mislabelled = served.ops["b"] / "aloe_operator.safetensors"  # config says n=3; the header holds 2 writes
    tensors = load_file(str(mislabelled))
    save_file({**tensors, "writes": tensors["writes"][:2].contiguous()}, str(mislabelled))
    status, out = call(served.mw, served.engine, "POST", {"path": str(served.ops["b"])})
    assert status == 422 and "tensor 'writes' has shape (2, 8) in the file's header" in out["error"], out
    padded = served.ops["a"] / "aloe_operator.safetensors"
    with padded.open("ab") as f:
        f.write(b"\0" * (2 << 20))
    status, out = call(served.mw, served.engine, "POST", {"path": str(served.ops["a"])})
    assert status == 422 and "more than the" in out["error"], out
    assert all(w.layer.live["operator_hash"] == "start" for w in served.engine.workers)
    assert all(getattr(w, "_aloe_staging", None) is None for w in served.engine.workers)  # released


def test_a_swap_in_progress_elsewhere_gets_409(served):
    """Another API process's swap holds the staging slots: 409, its staging untouched; then a retry works."""
    other = served.engine.workers[0].aloe_stage(str(served.ops["b"]), "other-process")
    served.engine.workers[1].aloe_stage(str(served.ops["b"]), "other-process")
    assert other == {"state": "pending"}
    status, out = call(served.mw, served.engine, "POST", {"path": str(served.ops["a"])})
    assert status == 409 and "in progress" in out["error"], out
    assert all(w._aloe_staging.ticket == "other-process" for w in served.engine.workers)
    for w in served.engine.workers:
        w.aloe_release("other-process")
    assert call(served.mw, served.engine, "POST", {"path": str(served.ops["a"])})[0] == 200


def test_failed_commit_on_one_rank_leaves_every_rank_on_the_old_operator(served):
    """Rank 1's write fails mid-commit: rank 0, which had committed, undoes it in the same call; the
    answer is 500 with both ranks on the old operator, and the next swap goes through."""
    call(served.mw, served.engine, "POST", {"path": str(served.ops["a"])})
    live = _hash(served.ops["a"])
    served.engine.workers[1].layer.fail_next = True
    status, out = call(served.mw, served.engine, "POST", {"path": str(served.ops["b"])})
    assert status == 500 and "failed on another rank" in out["error"], out
    assert out["operator"]["rank_hashes"] == [live, live]
    assert [w.layer.live["operator_hash"] for w in served.engine.workers] == [live, live]
    assert all(getattr(w, "_aloe_staging", None) is None for w in served.engine.workers)
    status, out = call(served.mw, served.engine, "POST", {"path": str(served.ops["b"])})
    assert status == 200 and out["rank_hashes"] == [_hash(served.ops["b"])] * 2, out


def test_ranks_that_disagree_are_reported(served):
    served.engine.workers[1].layer.live["operator_hash"] = "other"
    status, out = call(served.mw, served.engine, "GET")
    assert status == 500 and len(out["operator"]["ranks_disagree"]) == 2


def test_unexpected_load_errors_are_named_not_quoted(served, monkeypatch):
    """A failure that is not one of our checks: 422 naming its type; its text stays in the server log."""

    def broken(*args, **kwargs):
        raise RuntimeError("internal detail /srv/secret")

    monkeypatch.setattr(AloeOperator, "load", broken)
    status, out = call(served.mw, served.engine, "POST", {"path": str(served.ops["a"])})
    assert status == 422 and "RuntimeError" in out["error"] and "secret" not in out["error"], out


def test_servers_that_cannot_swap_safely_refuse(served):
    """Data parallelism, or a KV connector (the prefix cache could not be reset): 501, nothing run."""
    engine = Engine(data_parallel=2)
    status, out = call(served.mw, engine, "POST", {"path": str(served.ops["a"])})
    assert status == 501 and "data parallelism" in out["error"] and engine.calls == []
    engine = Engine()
    engine.vllm_config.kv_transfer_config = SimpleNamespace(kv_connector="any")
    status, out = call(served.mw, engine, "POST", {"path": str(served.ops["a"])})
    assert status == 501 and "KV connector" in out["error"] and engine.calls == []


def test_short_admin_key_stops_the_middleware(monkeypatch):
    monkeypatch.setenv(ADMIN_KEY_ENV, "too-short")
    with pytest.raises(ValueError, match="at least 16 characters"):
        AloeAdminMiddleware(None)
