"""Finding 2: operators were trusted on first use per self-chosen name, keys read from the request.

Before: a fresh key named "mallory" deployed a workload, "mallory2" deleted a real one, and a
fresh key under an existing name was dropped silently while its client hung. Now the fog
accepts control requests only from identities issued on the fog host (``fogline operators
add``, keys pinned in trust.db), within their role (an app may not deploy), and a request it
cannot accept gets a one-line, id-less ``ControlReply`` on the signer's own reply topic.

The attackers hold real TLS identities of the site (an app, a stolen operator certificate)
and write requests by hand, against ``fogline broker`` started the way the README says.
"""
from __future__ import annotations

import queue
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime import codec
from runtime.broker import find_mosquitto
from runtime.credentials import Credentials, load_credentials
from runtime.errors import LocalViolation
from runtime.messages import ControlReply, ControlRequest
from runtime.mqtt import Inbound, MqttClient
from runtime.security import Identity, Signer
from runtime.topics import Topics
from simulations.local_site import LocalSite

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

REPO = Path(__file__).resolve().parents[2]
T = Topics("default")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSite]:
    s = LocalSite(tmp_path_factory.mktemp("ops") / "fog").start()
    try:
        with s.client() as c:  # the workload the attackers go after
            c.deploy({"name": "victim", "model": "zoo:mlp", "source": "d", "sink": "d"})
        yield s
    finally:
        s.stop()


def _issued(site: LocalSite, name: str, role: str = "operator") -> Credentials:
    """``fogline operators add NAME --role ROLE``, then one hello: the broker's ACL knows it."""
    from fog_broker.client import FogClient
    if not site.credentials(name).exists():
        site.issue(name, role)
        FogClient("127.0.0.1", site.port, credentials=site.credentials(name)).close()
    return load_credentials(site.credentials(name))


def _raw(creds: Credentials, port: int, subs: dict[str, Any] | None = None) -> MqttClient:
    """A hand-written MQTT connection with an issued TLS identity (no FogClient, no protocol help)."""
    c = MqttClient(creds.name, "127.0.0.1", port, tls=creds.tls_for(creds.fog.fog_id))
    for topic, handler in (subs or {}).items():
        c.subscribe(topic, handler)
    c.start()
    assert c.wait_connected(10), c.last_error
    return c


def _request(signer: Signer, rid: str, action: str, reply_to: str, body: bytes = b"{}") -> bytes:
    return signer.seal_bytes(ControlRequest(rid, action, reply_to, body), time.time())


def _workloads(site: LocalSite) -> set[str]:
    with site.client() as c:
        return {w["name"] for w in c.status()["workloads"]}


def _counters(site: LocalSite) -> dict[str, int]:
    with site.client() as c:
        return dict(c.status()["counters"])


def test_a_key_nobody_issued_controls_nothing(site: LocalSite) -> None:
    """Self-chosen names with fresh keys, over a real (app) TLS connection: no deploy, no delete."""
    app = _issued(site, "app-m", "app")
    before = _counters(site).get("control.rejected:signer not topic", 0)
    c = _raw(app, site.port)
    try:
        for name, action, body in (("mallory", "deploy", b'{"name": "pwned", "model": "zoo:mlp", "source": "d", '
                                                         b'"sink": "d"}'),
                                   ("mallory2", "delete", b'{"name": "victim"}')):
            signer = Signer(Identity.generate(name), 1)
            assert c.publish(T.control("app-m"), _request(signer, f"r-{name}", action, T.reply(name), body)).wait(5)
    finally:
        c.stop()
    # on the app's own topic (the only one it may write) and signed by another name: dropped unchecked
    wait_for(lambda: _counters(site).get("control.rejected:signer not topic", 0) >= before + 2, 10,
             "the fog to see the forged requests", interval=0.2)
    assert _workloads(site) == {"victim"}


def test_a_valid_certificate_signing_as_another_name_is_refused(site: LocalSite) -> None:
    app = _issued(site, "app-n", "app")
    before = _counters(site).get("control.rejected:signer not topic", 0)
    c = _raw(app, site.port)
    try:
        forged = Signer(Identity("admin", app.signing._key), 1)  # the app's own key, the admin's name
        assert c.publish(T.control("app-n"), _request(forged, "r-as-admin", "delete", T.reply("admin"),
                                               b'{"name": "victim"}')).wait(5)
    finally:
        c.stop()
    wait_for(lambda: _counters(site).get("control.rejected:signer not topic", 0) >= before + 1, 10,
             "the fog to see the forged request", interval=0.2)
    assert "victim" in _workloads(site)


def test_a_stolen_certificate_with_its_own_key_gets_a_one_line_refusal(site: LocalSite, tmp_path: Path) -> None:
    """A fresh key under an issued name: refused at the first request with one line, not a hang."""
    from fog_broker.client import FogClient
    real = _issued(site, "op-b")
    stolen = tmp_path / "stolen"
    shutil.copytree(real.dir, stolen)
    (stolen / "signing.key").unlink()
    Identity.generate("op-b").save(stolen / "signing.key")
    t0 = time.monotonic()
    with pytest.raises(LocalViolation) as exc:
        FogClient("127.0.0.1", site.port, credentials=stolen, connect_timeout=5)
    assert time.monotonic() - t0 < 10
    assert str(exc.value) == "fog fog-default refused op-b: request refused: bad signature"
    with FogClient("127.0.0.1", site.port, credentials=real.dir) as c:  # the real op-b is unaffected
        assert c.hello["you"] == "op-b" and c.hello["role"] == "operator"


def test_a_refusal_in_someone_else_s_name_is_told_apart(site: LocalSite) -> None:
    """The id-less refusal names no request, and the fog cannot see who published a request.

    So an app that signs garbage in an operator's name (with its own key) makes the fog put a
    refusal on that operator's reply topic; ``FogClient`` ends every request it is waiting for on
    an id-less refusal. The operator's client must be able to tell such a stray refusal from the
    refusal of a request it sent itself (here: one signed with a broken key under its own name),
    else any issued identity can fail any other identity's in-flight deploys and inferences
    (the end-to-end effect is test_data_plane.py::test_a_stray_refusal_does_not_end_a_pending_inference).
    """
    victim = _issued(site, "op-v")
    app = _issued(site, "app-v", "app")
    got: queue.Queue[Inbound] = queue.Queue()
    v = _raw(victim, site.port, {T.reply("op-v"): got.put})
    a = _raw(app, site.port)

    def replies_until(rid: str) -> list[ControlReply]:
        out = []
        deadline = time.monotonic() + 10
        while True:
            env = codec.decode(got.get(timeout=max(0.1, deadline - time.monotonic())).payload)
            reply = codec.decode(env.payload)  # type: ignore[attr-defined]
            assert isinstance(reply, ControlReply)
            if reply.request_id == rid:
                assert reply.ok
                return out
            out.append(reply)

    try:
        assert v.wait_subscribed(T.reply("op-v"), 10)
        mine = Signer(victim.signing, time.time_ns() // 1_000_000)
        # the stray: the app's key under op-v's name, sent by the app
        forged = Signer(Identity("op-v", app.signing._key), 1)
        assert a.publish(T.control("app-v"), _request(forged, "theirs", "status", T.reply("op-v"))).wait(5)
        assert v.publish(T.control("op-v"), _request(mine, "sync1", "hello", T.reply("op-v"))).wait(5)
        strays = replies_until("sync1")
        # op-v's own refused request: the same reason (a bad signature under its name), sent by op-v
        broken = Signer(Identity("op-v", Identity.generate("x")._key), 2)
        assert v.publish(T.control("op-v"), _request(broken, "own", "status", T.reply("op-v"))).wait(5)
        assert v.publish(T.control("op-v"), _request(mine, "sync2", "hello", T.reply("op-v"))).wait(5)
        own = replies_until("sync2")
    finally:
        a.stop()
        v.stop()
    assert len(own) == 1 and not own[0].ok and own[0].error == "request refused: bad signature"
    assert all(s != own[0] for s in strays), (
        f"op-v cannot tell a refusal caused by app-v's forgery {strays} from the refusal of its own request {own}")


def test_roles_bound_what_an_issued_identity_may_do(site: LocalSite) -> None:
    from fog_broker.client import ControlError, FogClient
    app = _issued(site, "app-r", "app")
    coord = _issued(site, "coord-r", "coordinator")
    for creds in (app, coord):
        with FogClient("127.0.0.1", site.port, credentials=creds.dir) as c:
            with pytest.raises(ControlError, match=f"{creds.name} \\({creds.role}\\) may not 'deploy'"):
                c.deploy({"name": f"by-{creds.role}", "model": "zoo:mlp", "source": "d", "sink": "d"}, timeout=10)
            with pytest.raises(ControlError, match="may not 'delete'"):
                c.delete("victim", timeout=10)
    assert _workloads(site) == {"victim"}


def test_operators_add_and_revoke_on_the_fog_host(site: LocalSite) -> None:
    """The legitimate path: `fogline operators add` issues an identity that works at once; revoke ends it."""
    from fog_broker.client import ControlError, FogClient
    out = subprocess.run([sys.executable, "-m", "runtime.cli", "operators", "add", "ops2", "--data-dir",
                          str(site.data_dir)], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    creds = site.credentials("ops2")
    with FogClient("127.0.0.1", site.port, credentials=creds) as c:
        c.deploy({"name": "by-ops2", "model": "zoo:mlp", "source": "d", "sink": "d"})
        assert "by-ops2" in {w["name"] for w in c.status()["workloads"]}
        c.delete("by-ops2")
        out = subprocess.run([sys.executable, "-m", "runtime.cli", "operators", "revoke", "ops2", "--data-dir",
                              str(site.data_dir)], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        deadline = time.monotonic() + 15  # the fog re-reads trust.db within trust_poll_s
        while True:
            try:
                c.control("hello", timeout=2)
            except (ControlError, TimeoutError):
                break
            assert time.monotonic() < deadline, "ops2 still answered 15 s after its revocation"
            time.sleep(0.2)
        with pytest.raises((ControlError, TimeoutError)):
            c.deploy({"name": "after-revoke", "model": "zoo:mlp", "source": "d", "sink": "d"}, timeout=3)
    with pytest.raises(LocalViolation):  # and it cannot come back (certificate revoked, key unpinned)
        FogClient("127.0.0.1", site.port, credentials=creds, connect_timeout=5)
    assert "after-revoke" not in _workloads(site)
