"""Every route behind the API key: an ASGI middleware qserve adds to vLLM's server (`--middleware`).

vLLM 0.32 checks the key only under /v1, /v2, /inference and /cohere
(vllm/entrypoints/serve/middleware/authenticate.py, GUARDED_PREFIX): /invocations and
/generative_scoring run the model, and /scale_elastic_ep changes the server, without it. With a
key, this middleware refuses every request without it, except the monitoring probes below.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from typing import Any

# Read-only probes that load balancers and monitors call without credentials.
OPEN = {("GET", "/health"), ("GET", "/ping"), ("GET", "/version"), ("GET", "/metrics")}
MIDDLEWARE = "qserve.serve.auth.KeyOnEveryRoute"


class KeyOnEveryRoute:
    """Pure ASGI middleware: 401 for any request without `Authorization: Bearer $VLLM_API_KEY`."""

    def __init__(self, app: Any) -> None:
        self.app = app
        key = os.environ.get("VLLM_API_KEY", "")
        self.digest = hashlib.sha256(key.encode()).digest() if key else None

    def _authorized(self, scope: dict) -> bool:
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        given = hashlib.sha256(token.encode()).digest()
        return scheme.lower() == "bearer" and secrets.compare_digest(given, self.digest or b"")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if self.digest is None or scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            return await self.app(scope, receive, send)
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        if (scope.get("method"), path) in OPEN or self._authorized(scope):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": "Unauthorized"}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})
