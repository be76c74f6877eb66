"""Secrets in URLs (kvstore/redact.py): what is logged never shows the password."""
from __future__ import annotations

from kvmesh.kvstore.redact import redact_url


def test_urls_lose_their_password_in_logs():
    assert redact_url("redis://:pw@h:6380/0") == "redis://:***@h:6380/0"
    assert redact_url("index rediss://user:p%40ss@h/1 down") == "index rediss://user:***@h/1 down"
    assert redact_url("redis://h:6380/0") == "redis://h:6380/0"
