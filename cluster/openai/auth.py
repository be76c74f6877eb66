"""API keys: `Authorization: Bearer <key>` on every route but /health.

Keys come from `ingress.api_keys` (config), `kvmesh serve --api-key` (repeatable) or
`KVMESH_API_KEY` (comma-separated). They are held as pydantic SecretStr, compared in
constant time, and never logged, echoed in an error, or exported as a metric label.
"""
from __future__ import annotations

import hmac
import os
from typing import Iterable

from pydantic import SecretStr

from cluster.errors import APIError

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
