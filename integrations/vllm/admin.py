"""``/v1/aloe/operator`` on vLLM's OpenAI-compatible server: live operator swaps over HTTP.

Installed through vLLM's own extension points (``aloe serve --admin-key`` adds both):
``--middleware aloe_vllm.admin.AloeAdminMiddleware`` (this ASGI middleware,
which answers the one path and passes everything else through) and
``--worker-extension-cls aloe_vllm.worker.AloeWorkerExtension`` (the worker
side). The admin key comes from the environment variable ``ALOE_ADMIN_KEY``
(kept off the server's command line); without it the path is not served (404
from vLLM, as for any unknown path).

- ``GET /v1/aloe/operator`` -> ``{"n", "capacity", "operator_hash", "loaded_at"}``;
- ``POST /v1/aloe/operator`` with ``{"path": DIR}`` -> the same, for the new
  operator, once it is live. A refused operator gets 422 with ``{"error": reason}``
  and the old one keeps serving; a malformed request 400.

Both need ``Authorization: Bearer KEY`` (401 otherwise, nothing changes).
Swaps are serialized; the protocol (stage in the background, commit between
two engine steps on every rank) is in :mod:`aloe_vllm.swap`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import secrets
import time
from pathlib import Path

from starlette.datastructures import Headers
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from .swap import SwapRefused, operator_info, staged_hash

__all__ = ["ADMIN_KEY_ENV", "ROUTE", "AloeAdminMiddleware"]

ADMIN_KEY_ENV = "ALOE_ADMIN_KEY"
ROUTE = "/v1/aloe/operator"
_STAGE_TIMEOUT_S = 300.0
# Each poll is an RPC the engine answers between two steps: often enough for a swap to land
# within a few steps of the load, rarely enough not to slow decoding.
_POLL_S = 0.05


def _authorized(headers: Headers, key_hash: bytes) -> bool:
    scheme, _, token = (headers.get("authorization") or "").partition(" ")
    given = hashlib.sha256(token.strip().encode()).digest()
    return scheme.lower() == "bearer" and secrets.compare_digest(given, key_hash)


async def _swap(engine, path: str) -> dict:
    """Stage on every rank, wait until all hold the same operator, commit (see :mod:`aloe_vllm.swap`)."""
    await engine.collective_rpc("aloe_stage", args=(path,))
    deadline = time.monotonic() + _STAGE_TIMEOUT_S
    while (digest := staged_hash(await engine.collective_rpc("aloe_staged"))) is None:
        if time.monotonic() > deadline:
            raise SwapRefused(f"{path}: not loaded after {_STAGE_TIMEOUT_S:.0f}s")
        await asyncio.sleep(_POLL_S)
    return operator_info(await engine.collective_rpc("aloe_commit", args=(digest,)))


class AloeAdminMiddleware:
    """Pure ASGI middleware serving ``GET`` / ``POST /v1/aloe/operator`` (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        key = os.environ.get(ADMIN_KEY_ENV, "")
        self.key_hash = hashlib.sha256(key.encode()).digest() if key else None
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
            return JSONResponse(operator_info(await engine.collective_rpc("aloe_operator_info")))
        if request.method != "POST":
            return JSONResponse({"error": f"{request.method} not allowed; use GET or POST"}, 405)
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            return JSONResponse({"error": f"the body is not JSON ({exc})"}, 400)
        path = body.get("path") if isinstance(body, dict) else None
        if not isinstance(path, str) or not path:
            return JSONResponse({"error": 'expected a JSON object {"path": "<operator directory>"}'}, 400)
        path = str(Path(path).expanduser().resolve())
        async with self.lock:  # one swap at a time: a second waits for the first to finish
            try:
                return JSONResponse(await _swap(engine, path))
            except SwapRefused as exc:
                return JSONResponse({"error": str(exc)}, 422)
