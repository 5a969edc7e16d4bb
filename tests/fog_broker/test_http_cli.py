"""``fogline broker --http`` refusals that need no running broker, and ``fogline api-token``."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fog_broker.api_auth import verify_token
from runtime.errors import LocalViolation

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]


def _fogline(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "runtime.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_plain_http_is_refused_off_loopback(tmp_path: Path) -> None:
    # the MQTT side is on loopback (--mqtt), the HTTP API would listen on every address: refused
    r = _fogline(["broker", "--insecure", "--mqtt", "127.0.0.1:1", "--host", "0.0.0.0", "--http", "0",
                  "--data-dir", str(tmp_path / "fog"), "--no-zeroconf"])
    assert r.returncode == 2 and "plain HTTP only on a loopback address" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "fog").exists()


def test_the_adapter_refuses_plain_http_off_loopback_too() -> None:
    from fog_broker.http_api import HttpApi
    with pytest.raises(LocalViolation, match="only on a loopback address"):
        HttpApi(object(), "0.0.0.0", 0, tls_dir=None)  # type: ignore[arg-type]


def test_missing_aiohttp_is_one_clear_line(tmp_path: Path) -> None:
    fake = tmp_path / "site" / "aiohttp"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('No module named aiohttp')\n")
    r = _fogline(["broker", "--insecure", "--http", "0", "--data-dir", str(tmp_path / "fog"), "--no-zeroconf"],
                 env={"PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT}"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "error: --http needs aiohttp, which is not installed: pip install 'fogline[fog]' "
        "(or pip install 'aiohttp>=3.9')"]


def test_bad_http_port(tmp_path: Path) -> None:
    r = _fogline(["broker", "--insecure", "--http", "70000", "--data-dir", str(tmp_path / "fog")])
    assert r.returncode == 2 and "not a TCP port" in r.stderr


def test_api_token_from_a_credentials_dir(tmp_path: Path) -> None:
    from fog_broker.site import Site
    site = Site(tmp_path / "fog", site="s1", fog_id="fog-s1")
    try:
        creds = site.issue_credentials("cam-app", "app", None, time.time())
        r = _fogline(["api-token", "--credentials", str(creds), "--ttl", "15m", "--json"])
        assert r.returncode == 0, r.stderr
        doc = json.loads(r.stdout)
        assert doc["name"] == "cam-app" and doc["fog_id"] == "fog-s1"
        p = verify_token(doc["token"], site.db.identity, site="s1", fog_id="fog-s1", now=time.time())
        assert p.name == "cam-app" and p.role == "app" and p.expires_at - time.time() == pytest.approx(900, abs=5)
        r = _fogline(["api-token", "--credentials", str(creds), "--ttl", "90d"])
        assert r.returncode == 2 and "at most 30d" in r.stderr
        r = _fogline(["api-token", "--credentials", str(tmp_path / "nothing")])
        assert r.returncode == 2 and r.stderr.startswith("error: argument --credentials")
        assert "does not exist" in r.stderr
    finally:
        site.close()
