"""What Ray Serve's HTTP proxy answers by itself, before kvmesh's app sees a request.

The proxy serves two paths of its own on every HTTP port, outside any app and so outside the API
key: `/-/healthz` (the text "success": a liveness probe, as open as kvmesh's `/health`) and
`/-/routes` (every application's name and route prefix, a map of the deployment). Ray Serve 2.60
has no setting that turns either off or puts it behind a key; what it offers is an ASGI middleware
around the whole proxy, named by `RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` in the proxy
process's environment (Serve's `http_options.middlewares` is removed: a non-empty list raises).
`middlewares()` is that callback: `/-/routes` is not served (404, OpenAI's error body), whoever
asks and whatever key they send; every other request passes through untouched.

`kvmesh serve` sets the variable before it starts its local Ray (`RAY_ENV`); on a cluster started
by `ray start`, the head's `ray start` must have it in its environment (deploy/*.yaml do;
docs/security.md). Importing this module loads nothing but the standard library: it runs inside
Serve's proxy actor.
"""
from __future__ import annotations

import json

PROXY_CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
CALLBACK = "kvmesh.cluster.openai.proxy_guard.middlewares"
RAY_ENV = {PROXY_CALLBACK_ENV: CALLBACK}
HIDDEN_PATHS = frozenset({"/-/routes"})
_NOT_FOUND = json.dumps({"error": {"message": "Not Found", "type": "not_found_error", "param": None,
                                   "code": None}}).encode()


class HideProxyRoutes:
    """ASGI middleware: a 404 for the proxy's own paths in HIDDEN_PATHS (under an ASGI root
    path too, which the proxy strips the same way), everything else to the proxy."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope.get("type") == "http" and self.hidden(scope):
            await send({"type": "http.response.start", "status": 404,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(_NOT_FOUND)).encode())]})
            await send({"type": "http.response.body", "body": _NOT_FOUND})
            return
        await self.app(scope, receive, send)

    @staticmethod
    def hidden(scope) -> bool:
        path, root = scope.get("path", ""), scope.get("root_path", "")
        return path[len(root):] in HIDDEN_PATHS


def middlewares() -> list:
    """The proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): Starlette Middleware list."""
    from starlette.middleware import Middleware
    return [Middleware(HideProxyRoutes)]
