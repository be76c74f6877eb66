"""API keys: `Authorization: Bearer <key>` on every route but /health.

`require_api_key(keys_of)` is the FastAPI dependency that checks them; the ingress puts it on
its whole app, so no route checks a key by hand and a new route is behind the key unless its
path is in OPEN_PATHS.

Keys come from `ingress.api_keys` (config), `kvmesh serve --api-key` (repeatable) or
`KVMESH_API_KEY` (comma-separated). They are held as pydantic SecretStr, compared in
constant time, and never logged, echoed in an error, or exported as a metric label.
"""
import hashlib
import hmac
import os
from typing import Callable, Iterable

from fastapi import Depends, Request
from fastapi.params import Depends as Dependency
from pydantic import SecretStr

from kvmesh.cluster.errors import APIError

ENV_VAR = "KVMESH_API_KEY"
OPEN_PATHS = frozenset({"/health"})


def keys_from_env(environ=os.environ) -> list[str]:
    return [k.strip() for k in environ.get(ENV_VAR, "").split(",") if k.strip()]


class ApiKeys:
    def __init__(self, keys: Iterable[SecretStr | str]):
        self._keys = [(k.get_secret_value() if isinstance(k, SecretStr) else k).encode() for k in keys]

    @property
    def enabled(self) -> bool:
        return bool(self._keys)

    def check(self, path: str, authorization: str | None) -> None:
        """Raises the 401 OpenAI sends when the key is missing or wrong."""
        if not self._keys or path in OPEN_PATHS:
            return
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise APIError(401, "You didn't provide an API key. Provide it in the Authorization header "
                                "(Authorization: Bearer YOUR_KEY).", code="invalid_api_key")
        given = token.strip().encode()
        if not any(hmac.compare_digest(given, k) for k in self._keys):   # no early exit on a prefix
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._keys)} keys)"


def client_of(request: Request, keyed: bool) -> str:
    """Who sent `request`, as the workers share grammar compiles between clients
    (cluster/serve/grammar_gate.py): with API keys on (`keyed`), its key (an 8-byte BLAKE2b id: the
    key itself never leaves the ingress); else its address (every connection from one host is one
    client; behind a proxy, the proxy's). Without keys a token names no one: any client could send
    a new one with each request."""
    scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
    if keyed and scheme.lower() == "bearer" and token.strip():
        return "key:" + hashlib.blake2b(token.strip().encode(), digest_size=8).hexdigest()
    return "addr:" + (request.client.host if request.client else "?")


def app_path(request: Request) -> str:
    """The request's path inside the app: under a Serve route prefix (`/colocated`), without it."""
    return request.url.path.removeprefix(request.scope.get("root_path", "")) or "/"


def require_api_key(keys_of: Callable[[], ApiKeys]) -> Dependency:
    """A FastAPI dependency (for `FastAPI(dependencies=[...])` or a route's) that raises
    OpenAI's 401 for a request without a listed key, unless its path is open; `keys_of()` gives
    the keys in force when the request arrives. It runs before the route reads the body."""
    # No `from __future__ import annotations` in this module: Serve copies the app by cloudpickle,
    # and the copy of this closure could not resolve "Request" from a string.
    async def api_key(request: Request) -> None:
        keys_of().check(app_path(request), request.headers.get("authorization"))
    return Depends(api_key)
