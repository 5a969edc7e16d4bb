"""Issue 20 finding 3: an identifier ending in a newline rewrote the broker's ACL.

Before: one use of an auto-approve token enrolled ``"a\\n"`` (``re.match(r"^...$")``
lets a final newline through); its lines broke mosquitto's ACL, the reload
failed and mosquitto went on with no ACL at all (every device could read the
operators' control requests and publish on other devices' and fog-only topics),
and the fog could not start again ("mosquitto did not open port"). Now one id
grammar (``runtime.ids``, whole-string match) guards enrolment, certificates,
topics and the ACL writer; a new ACL is checked line by line and test-loaded by
mosquitto before it is written and reloaded. Real ``fogline broker``, real
mosquitto, the attacker speaks raw HTTPS.
"""
from __future__ import annotations

import queue
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from _enrol_attacker import bearer, csr_for, post_enrol
from test_runtime_tls_acl import MARK, drain_until_marker, wait_live

from runtime.broker import (
    BrokerConfig,
    MosquittoBroker,
    _run_dir,
    acl_for,
    check_acl,
    find_mosquitto,
)
from runtime.errors import LocalViolation
from runtime.mqtt import Inbound, MqttClient, TlsConfig
from runtime.security import Identity
from runtime.topics import Topics
from simulations.local_site import LocalSite

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

T = Topics("default")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSite]:
    s = LocalSite(tmp_path_factory.mktemp("acl-site") / "fog").start()
    try:
        yield s
    finally:
        s.stop()


def _acl_text(site: LocalSite) -> str:
    return (_run_dir(site.data_dir / "mqtt") / "acl").read_text()


def _enrol_device(site: LocalSite, name: str, token: str, where: Path) -> TlsConfig:
    """A device enrolled through the real endpoint: its TLS identity on disk."""
    key_pem, csr = csr_for(name)
    status, answer = post_enrol(site.enroll, name, csr, bearer(token))
    assert status == 200, answer
    where.mkdir(parents=True, exist_ok=True)
    (where / "key.pem").write_bytes(key_pem)
    (where / "cert.pem").write_text(answer["certificate"])
    (where / "ca.pem").write_text(answer["ca"])
    return TlsConfig(str(where / "ca.pem"), str(where / "cert.pem"), str(where / "key.pem"), site.ready["fog_id"])


def _connect(name: str, site: LocalSite, tls: TlsConfig, subs: dict[str, queue.Queue[Inbound]],
             made: list[MqttClient]) -> MqttClient:
    c = MqttClient(name, "127.0.0.1", site.port, tls=tls)
    for topic, q in subs.items():
        c.subscribe(topic, q.put)
    made.append(c)
    c.start()
    assert c.wait_connected(10), f"{name} could not connect"
    return c


def test_newline_id_is_refused_and_the_acl_still_confines_devices(site: LocalSite, tmp_path: Path) -> None:
    token = site.token(uses=3, auto_approve=True)
    acl_before = _acl_text(site)
    for evil in ("a\n", "b\r", "c d", "dev/x", "+", "a" * 65, "..x", "-x"):
        _, csr = csr_for(evil)
        status, answer = post_enrol(site.enroll, evil, csr, bearer(token))
        assert status == 400, (evil, status, answer)
        assert "invalid device id" in answer["error"] and "\n" not in answer["error"]
    assert _acl_text(site) == acl_before  # nothing was enrolled, nothing rewritten
    check_acl(_acl_text(site))
    # the token was not spent by the refusals: two honest devices enrol with it
    made: list[MqttClient] = []
    try:
        dev = _enrol_device(site, "dev-ok", token, tmp_path / "dev-ok")
        obs = _enrol_device(site, "dev-obs", token, tmp_path / "dev-obs")
        check_acl(_acl_text(site))
        # an ordinary device cannot read others' control requests ...
        q_dev: queue.Queue[Inbound] = queue.Queue()
        d = _connect("dev-ok", site, dev, {T.control("+"): q_dev, T.activation("dev-ok", "+"): q_dev}, made)
        q_obs: queue.Queue[Inbound] = queue.Queue()
        o = _connect("dev-obs", site, obs, {T.fog_state(): q_obs, T.device("dev-obs", "CMD"): q_obs,
                                            T.activation("dev-obs", "+"): q_obs}, made)
        wait_live(q_dev, o, T.activation("dev-ok", "dev-obs"))
        wait_live(q_obs, d, T.activation("dev-obs", "dev-ok"))
        from runtime.credentials import load_credentials
        c = load_credentials(site.credentials())
        admin = MqttClient(c.name, "127.0.0.1", site.port, tls=c.tls_for(c.fog.fog_id))
        made.append(admin)
        admin.start()
        assert admin.wait_connected(10)
        assert admin.publish(T.control(c.name), b"an operator's request", qos=1).wait(5)
        o.publish(T.activation("dev-ok", "dev-obs"), MARK, qos=1)
        assert drain_until_marker(q_dev) == []
        # ... nor publish on another device's or a fog-only topic
        d.publish(T.fog_state(), b"forged fog state", qos=1)
        d.publish(T.device("dev-obs", "CMD"), b"forged command", qos=1)
        d.publish(T.activation("dev-obs", "fog-default"), b"as the fog", qos=1)
        d.publish(T.activation("dev-obs", "dev-ok"), MARK, qos=1)
        assert drain_until_marker(q_obs) == []
    finally:
        for m in made:
            m.stop()
    assert "Invalid line" not in (site.data_dir / "mqtt" / "mosquitto.log").read_text(errors="replace")


def test_fog_restarts_with_a_stored_newline_id(tmp_path: Path) -> None:
    """A trust.db written before names were checked whole: the fog starts, the bad name gets no right."""
    from fog_broker.trust import DeviceRecord
    from fog_broker.trust_db import TrustDB

    s = LocalSite(tmp_path / "fog").start()
    port = s.port
    s.stop()
    db = TrustDB(tmp_path / "fog" / "trust.db")
    db.put_device(DeviceRecord("b\n", "approved", Identity.generate("b").public_key_bytes, "", "manual", time.time()))
    db.close()
    s = LocalSite(tmp_path / "fog", port=port).start(timeout=60)
    try:
        acl = _acl_text(s)
        check_acl(acl)
        assert "user b" not in acl
        with s.client() as c:
            assert c.status()["fog_id"] == s.ready["fog_id"]
    finally:
        s.stop()


def test_broker_refuses_a_broken_acl_and_keeps_the_last_good_one(tmp_path: Path) -> None:
    """The ACL writer's own guard: a text with a broken line is never written; mosquitto test-loads
    what it is given and says why it refuses a file."""
    good = acl_for("s1", "fog-1", {"fog-1": "fog", "dev-a": "device"})
    b = MosquittoBroker(BrokerConfig(data_dir=tmp_path / "mq", acl=good, persistence=False)).start()
    try:
        live = b.run_dir / "acl"
        assert live.read_text() == good and (b.run_dir / "acl.good").read_text() == good
        broken = good.replace("user dev-a", "user a\n\ntopic write fogline/v1/s1/dev/a\n/BIRTH")
        with pytest.raises(LocalViolation, match="ACL line"):
            check_acl(broken)
        assert b.update_acl(broken) is False and b.refused["acl"] == 1
        assert live.read_text() == good and b.alive()
        bad_file = b._put("bad.acl", broken.encode())  # where the broker user may read it
        problem = b.test_load({"acl_file": bad_file})
        assert problem is not None and "Invalid line" in problem
        newer = acl_for("s1", "fog-1", {"fog-1": "fog", "dev-a": "device", "dev-b": "device"})
        assert b.update_acl(newer) is True and live.read_text() == newer and b.alive()
        assert not list(b.run_dir.glob("*.next")) and not list(b.run_dir.glob("*test.conf"))
    finally:
        b.stop()
    # the next start with a broken ACL falls back to the last good one, and mosquitto opens its port
    b = MosquittoBroker(BrokerConfig(data_dir=tmp_path / "mq", acl=broken, persistence=False)).start()
    try:
        assert b.alive() and (b.run_dir / "acl").read_text() == newer and b.refused["acl"] == 1
    finally:
        b.stop()
