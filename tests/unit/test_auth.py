"""API keys: Bearer check in constant time, OpenAI's 401 body, keys hidden from reprs."""
from __future__ import annotations

import pytest

from kvmesh.cluster.errors import APIError
from kvmesh.cluster.openai.auth import ApiKeys, keys_from_env
from kvmesh.cluster.config import ServeConfig


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
    import kvmesh.cluster.app as app
    seen = {}
    monkeypatch.setenv("KVMESH_API_KEY", "sk-env-1,sk-env-2")
    monkeypatch.setattr(app.Ingress, "options", lambda **kw: type("D", (), {"bind": lambda self, c, p: seen.update(c=c)})())
    monkeypatch.setattr(app, "_pool", lambda *a: type("P", (), {"bind": lambda self, *b: None})())
    app.build_app({"mode": "colocated"})
    ApiKeys(seen["c"].ingress.api_keys).check("/v1/models", "Bearer sk-env-2")
    assert "sk-env-1" not in repr(seen["c"])


def api_routes(router):
    """Every route of a FastAPI app, also those of routers it includes (Serve includes the class's)."""
    from fastapi.routing import APIRoute
    for route in router.routes:
        if isinstance(route, APIRoute):
            yield route
        elif hasattr(route, "original_router"):        # FastAPI >= 0.137 keeps included routers nested
            yield from api_routes(route.original_router)


@pytest.mark.parametrize("root_path", ["", "/colocated"])
def test_the_ingress_asks_every_route_but_health_for_the_key(monkeypatch, root_path):
    """One dependency on the whole app: a route added later is behind the key too. The app is
    copied through cloudpickle as @serve.ingress freezes it (names the copy cannot resolve, such as
    a string annotation, would make FastAPI ask for a query parameter instead)."""
    from fastapi.testclient import TestClient
    from ray import cloudpickle, serve
    from kvmesh.cluster.openai.ingress import api
    api = cloudpickle.loads(cloudpickle.dumps(api))
    ingress = type("Ingress", (), {"keys": ApiKeys(["sk-one"]), "config": ServeConfig()})()
    monkeypatch.setattr(serve, "get_replica_context", lambda: type("Ctx", (), {"servable_object": ingress}))
    client = TestClient(api, root_path=root_path)
    routes = [(m, r.path.replace("{model_id:path}", "m")) for r in api_routes(api) for m in r.methods]
    assert len(routes) >= 11
    for method, path in routes:
        r = client.request(method, root_path + path, headers={"Authorization": "Bearer sk-wrong"})
        if path == "/health":
            assert r.status_code == 200 and r.json()["mode"] == ingress.config.mode
        else:
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (method, path)
    assert client.get(root_path + "/version", headers={"Authorization": "Bearer sk-one"}).status_code == 200


# ---- Serve's proxy: /-/routes is not served (cluster/openai/proxy_guard.py) ----------------------
def test_the_proxy_guard_hides_routes_and_passes_everything_else():
    import asyncio

    from kvmesh.cluster.openai.proxy_guard import CALLBACK, HideProxyRoutes, middlewares
    from ray.serve._private.utils import call_function_from_import_path
    from ray.serve._private.http_util import validate_http_proxy_callback_return

    passed = []

    async def proxy(scope, receive, send):
        passed.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def call(path: str, root_path: str = "") -> list[dict]:
        sent: list[dict] = []

        async def send(message):
            sent.append(message)
        await HideProxyRoutes(proxy)({"type": "http", "path": path, "root_path": root_path}, None, send)
        return sent

    for path, root in (("/-/routes", ""), ("/api/-/routes", "/api")):
        sent = asyncio.run(call(path, root))
        assert sent[0]["status"] == 404 and b"not_found_error" in sent[1]["body"]
    for path in ("/-/healthz", "/v1/models", "/health", "/-/routes/x"):
        assert asyncio.run(call(path))[0]["status"] == 200
    assert passed == ["/-/healthz", "/v1/models", "/health", "/-/routes/x"]
    # what Serve's proxy does with RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH, on this Ray version
    assert [m.cls for m in validate_http_proxy_callback_return(call_function_from_import_path(CALLBACK))] == \
        [m.cls for m in middlewares()] == [HideProxyRoutes]
