"""``HttpApi.extend``: other endpoints (the site page, metrics) on the same server, auth and all.

An in-process ``FogService`` on a real mosquitto and a real ``HttpApi`` over TLS
(the site CA), called with ``requests``.
"""
from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.broker import MosquittoBroker, find_mosquitto

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]
requests = pytest.importorskip("requests")
pytest.importorskip("aiohttp")
if find_mosquitto() is None:  # pragma: no cover
    pytest.skip("mosquitto not installed", allow_module_level=True)


@pytest.fixture
def api(mosquitto: MosquittoBroker, tmp_path: Path) -> Iterator[Any]:
    from fog_broker.http_api import HttpApi
    from fog_broker.service import FogService, ServiceConfig
    svc = FogService(ServiceConfig(data_dir=tmp_path / "fog", site="ext", mqtt_port=mosquitto.port)).start()
    tls = svc.site.broker_tls_dir(["localhost"], ["127.0.0.1"])
    http = HttpApi(svc, "127.0.0.1", 0, tls_dir=tls)

    def register(app: Any, api: HttpApi) -> None:
        from aiohttp import web

        async def site_json(request: web.Request) -> web.Response:
            who = api.principal(request, "status")
            fog = await api.owner_call(lambda: svc.status(limit=0)["fog_id"])
            return web.json_response({"fog_id": fog, "you": who.name})
        app.router.add_get("/site.json", site_json)

    http.extend(register)
    http.start()
    try:
        yield svc, http, tls
    finally:
        http.stop()
        svc.stop()


def _token(svc: Any, name: str, role: str) -> str:
    from fog_broker.api_auth import mint_token
    from runtime.credentials import load_credentials
    creds = load_credentials(svc.site.issue_credentials(name, role, None, time.time()))
    return mint_token(creds.signing, svc.config.site, svc.config.fog_id, time.time(), 600, secrets.token_bytes(8))


def test_extension_routes_share_tls_auth_and_errors(api: Any) -> None:
    svc, http, tls = api
    url = f"https://127.0.0.1:{http.port}/site.json"
    ca = str(tls / "ca.pem")
    r = requests.get(url, verify=ca, headers={"Authorization": f"Bearer {_token(svc, 'ops', 'operator')}"})
    assert r.status_code == 200 and r.json() == {"fog_id": svc.config.fog_id, "you": "ops"}
    r = requests.get(url, verify=ca, headers={"Authorization": f"Bearer {_token(svc, 'cam', 'app')}"})
    assert r.status_code == 403 and r.json()["error"] == "cam (app) may not status"
    r = requests.get(url, verify=ca)
    assert r.status_code == 401 and "no credentials" in r.json()["error"]
    with pytest.raises(Exception, match="after start"):
        http.extend(lambda app, api: None)
