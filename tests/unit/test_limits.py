"""The request body limit (cluster/openai/limits.py): a body over the limit is a 413, whether
its length is declared or it arrives streamed."""
from __future__ import annotations

import asyncio

import pytest

from kvmesh.cluster.errors import APIError
from kvmesh.cluster.openai.limits import read_body


def test_body_limit_refuses_declared_and_streamed_bodies():
    class Req:
        def __init__(self, body, declared):
            self.headers = {"content-length": str(len(body))} if declared else {}
            self._body = body

        async def stream(self):
            for i in range(0, len(self._body), 10):
                yield self._body[i:i + 10]
    assert asyncio.run(read_body(Req(b"x" * 50, True), 50)) == b"x" * 50
    for declared in (True, False):
        with pytest.raises(APIError) as e:
            asyncio.run(read_body(Req(b"x" * 51, declared), 50))
        assert e.value.status == 413
