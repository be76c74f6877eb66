"""API keys: Bearer check in constant time, OpenAI's 401 body, keys hidden from reprs."""
from __future__ import annotations

import pytest

from cluster.errors import APIError
from cluster.openai.auth import ApiKeys, keys_from_env
from cluster.config import ServeConfig


def test_only_a_listed_bearer_key_passes_and_health_stays_open():
    keys = ApiKeys(["sk-one", "sk-two"])
    keys.check("/v1/models", "Bearer sk-one")
    keys.check("/v1/models", "bearer sk-two")
    keys.check("/health", None)
    for header in (None, "", "sk-one", "Bearer", "Bearer sk-on", "Bearer sk-one-more", "Basic sk-one"):
        with pytest.raises(APIError) as e:
            keys.check("/v1/completions", header)
        assert e.value.status == 401 and e.value.code == "invalid_api_key"
        assert "sk-one" not in e.value.message and "sk-two" not in e.value.message


def test_no_keys_means_no_auth():
    ApiKeys([]).check("/v1/completions", None)


def test_keys_come_from_the_environment_comma_separated():
    assert keys_from_env({"KVMESH_API_KEY": "sk-a, sk-b,,"}) == ["sk-a", "sk-b"]
    assert keys_from_env({}) == []


def test_keys_never_appear_in_the_config_repr_or_dump():
    config = ServeConfig.model_validate({"ingress": {"api_keys": ["sk-secret-1"]}})
    assert "sk-secret-1" not in repr(config) and "sk-secret-1" not in str(config.model_dump())
    assert "sk-secret-1" not in repr(ApiKeys(config.ingress.api_keys))
    ApiKeys(config.ingress.api_keys).check("/v1/models", "Bearer sk-secret-1")


def test_build_app_takes_keys_from_the_environment(monkeypatch):
    import cluster.app as app
    seen = {}
    monkeypatch.setenv("KVMESH_API_KEY", "sk-env-1,sk-env-2")
    monkeypatch.setattr(app.Ingress, "options", lambda **kw: type("D", (), {"bind": lambda self, c, p: seen.update(c=c)})())
    monkeypatch.setattr(app, "_pool", lambda *a: type("P", (), {"bind": lambda self, *b: None})())
    app.build_app({"mode": "colocated"})
    ApiKeys(seen["c"].ingress.api_keys).check("/v1/models", "Bearer sk-env-2")
    assert "sk-env-1" not in repr(seen["c"])
