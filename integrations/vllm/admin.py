"""``/v1/aloe/operator`` on vLLM's OpenAI-compatible server: live operator swaps over HTTP.

Installed through vLLM's own extension points (``aloe serve`` adds both when it has an admin key):
``--middleware aloe_vllm.admin.AloeAdminMiddleware`` (this ASGI middleware,
which answers the one path and passes everything else through) and
``--worker-extension-cls aloe_vllm.worker.AloeWorkerExtension`` (the worker
side). The admin key comes from the environment variable ``ALOE_ADMIN_KEY``
(kept off the server's command line; at least 16 characters, or the server does
not start); without it the path is not served (404 from vLLM, as for any
unknown path). Operators are read only from directories
under ``ALOE_ADMIN_ROOT`` (``aloe serve --admin-root``, by default the
directory that holds the served operator); without it every swap is refused.

- ``GET /v1/aloe/operator`` -> ``{"n", "capacity", "operator_hash", "loaded_at", "ranks",
  "rank_hashes"}`` (500 if the ranks serve different operators);
- ``POST /v1/aloe/operator`` with ``{"path": DIR}`` -> the same for the new operator, once
  it is live, plus ``"prefix_cache_reset"``. Answers that change nothing: 400 (malformed
  request), 403 (a path outside the operator root), 409 (another swap is in progress,
  perhaps from another API-server process), 422 (a refused operator, with the reason),
  501 (data parallelism, where vLLM would report only the first engine's answers, or a KV
  connector, with which the prefix cache cannot be reset).
  500 means the swap failed after it began (a rank's write failed: every rank is back on the
  old operator; or the prefix cache could not be reset): the body's ``operator`` is what serves.

Both need ``Authorization: Bearer KEY`` (401 otherwise, nothing changes).
Swaps are serialized; the protocol (stage in the background, commit between
two engine steps on every rank) is in :mod:`aloe_vllm.swap`. After a commit
the prefix cache is emptied and running requests are recomputed under the
new operator (vLLM's ``reset_prefix_cache(reset_running_requests=True)``), so
no KV computed under the old operator is read again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import secrets
import time
from pathlib import Path

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .format import ADMIN_KEY_ENV, ADMIN_ROOT_ENV, AloeSwapFailed, check_admin_key
from .swap import RanksDisagree, SwapBusy, SwapRefused, committed_info, new_ticket, operator_info, staged_hash

__all__ = ["ADMIN_KEY_ENV", "ADMIN_ROOT_ENV", "ROUTE", "AloeAdminMiddleware"]

log = logging.getLogger("aloe_vllm")

ROUTE = "/v1/aloe/operator"
_STAGE_TIMEOUT_S = 300.0
# Each poll is an RPC the engine answers between two steps: often enough for a swap to land
# within a few steps of the load, rarely enough not to slow decoding.
_POLL_S = 0.05


def _authorized(headers: Headers, key_hash: bytes) -> bool:
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    given = hashlib.sha256(token.strip().encode()).digest()
    return scheme.lower() == "bearer" and secrets.compare_digest(given, key_hash)


def _under_root(path: str, root: Path | None) -> Path | None:
    """``path`` resolved (symlinks followed) if it lies under ``root``, else None."""
    if root is None:
        return None
    where = Path(path).expanduser().resolve()
    return where if where.is_relative_to(root) else None


async def _swap(engine, path: str) -> dict:
    """Stage on every rank, wait until all hold the same operator, commit, reset the prefix cache
    (see :mod:`aloe_vllm.swap`). The staging slots are released whatever happens."""
    ticket = new_ticket()
    try:
        staged_hash(await engine.collective_rpc("aloe_stage", args=(path, ticket)))  # SwapBusy if taken
        deadline = time.monotonic() + _STAGE_TIMEOUT_S
        while (digest := staged_hash(await engine.collective_rpc("aloe_staged", args=(ticket,)))) is None:
            if time.monotonic() > deadline:
                raise SwapRefused(f"{path}: not loaded after {_STAGE_TIMEOUT_S:.0f}s")
            await asyncio.sleep(_POLL_S)
        info = committed_info(await engine.collective_rpc("aloe_commit", args=(digest, ticket)))
    finally:
        await engine.collective_rpc("aloe_release", args=(ticket,))
    try:
        reset = bool(await engine.reset_prefix_cache(reset_running_requests=True))
    except Exception:  # the swap stands; the caller is told the cache may hold stale KV
        log.exception("ALOE: the operator swapped but the prefix cache could not be reset")
        reset = False
    return {**info, "prefix_cache_reset": reset}


def _unsupported(config) -> str | None:
    """Why this server cannot swap safely, or None."""
    if getattr(getattr(config, "parallel_config", None), "data_parallel_size", 1) > 1:
        return "with data parallelism (vLLM runs the RPCs on every engine but returns only the first one's answers)"
    if getattr(config, "kv_transfer_config", None) is not None:
        return "with a KV connector (vLLM cannot reset the prefix cache while KV is in transfer)"
    return None


async def _live_or_unknown(engine) -> dict | str:
    try:
        return operator_info(await engine.collective_rpc("aloe_operator_info"))
    except RanksDisagree as exc:
        return {"ranks_disagree": exc.infos}
    except Exception:
        return "unknown"


class AloeAdminMiddleware:
    """Pure ASGI middleware serving ``GET`` / ``POST /v1/aloe/operator`` (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        key = os.environ.get(ADMIN_KEY_ENV, "")
        if key:
            check_admin_key(key)  # a short key stops the server at startup rather than serving weakly
        self.key_hash = hashlib.sha256(key.encode()).digest() if key else None
        root = os.environ.get(ADMIN_ROOT_ENV, "")
        self.root = Path(root).expanduser().resolve() if root else None
        self.lock = asyncio.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (
            scope["type"] != "http"
            or self.key_hash is None
            or scope["path"].removeprefix(scope.get("root_path", "")).rstrip("/") != ROUTE
        ):
            await self.app(scope, receive, send)
            return
        response = await self._handle(Request(scope, receive))
        await response(scope, receive, send)

    async def _handle(self, request: Request) -> JSONResponse:
        if not _authorized(request.headers, self.key_hash):
            return JSONResponse({"error": "Unauthorized: expected Authorization: Bearer <admin key>"}, 401)
        engine = request.app.state.engine_client
        if request.method == "GET":
            live = await _live_or_unknown(engine)
            return JSONResponse(live, 200) if isinstance(live, dict) and "n" in live else JSONResponse({"operator": live}, 500)
        if request.method != "POST":
            return JSONResponse({"error": f"{request.method} not allowed; use GET or POST"}, 405)
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return JSONResponse({"error": f"the body is not JSON ({exc})"}, 400)
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            return JSONResponse({"error": 'expected a JSON object {"path": "<operator directory>"}'}, 400)
        unsupported = _unsupported(getattr(engine, "vllm_config", None))
        if unsupported:
            return JSONResponse({"error": f"live swaps are not supported {unsupported}"}, 501)
        where = _under_root(path, self.root)
        if where is None:
            why = (
                f"operators are read only from under {self.root}"
                if self.root is not None
                else f"the server was started without {ADMIN_ROOT_ENV}, so it reads no operator (aloe serve sets it)"
            )
            return JSONResponse({"error": f"{path}: refused; {why}"}, 403)
        async with self.lock:  # one swap at a time per API process; the workers' staging slot covers the rest
            try:
                out = await _swap(engine, str(where))
                if not out["prefix_cache_reset"]:  # live, but cached KV of the old operator may be read
                    error = "the operator is live but the prefix cache could not be reset; reset it before relying on answers"
                    return JSONResponse({"error": error, "operator": out}, 500)
                return JSONResponse(out)
            except SwapBusy as exc:
                return JSONResponse({"error": str(exc)}, 409)
            except SwapRefused as exc:
                return JSONResponse({"error": str(exc)}, 422)
            except AloeSwapFailed as exc:  # a rank's write failed; every rank is back on the old operator
                log.error("ALOE: live swap of %s failed: %s", where, exc)
                return JSONResponse({"error": str(exc), "operator": exc.operator}, 500)
            except Exception as exc:
                log.exception("ALOE: live swap of %s failed", where)
                return JSONResponse(
                    {
                        "error": f"the swap failed ({type(exc).__name__}); the server log has the details",
                        "operator": await _live_or_unknown(engine),
                    },
                    500,
                )
