"""Issue 29 (lows): revocation closes live sessions; a flood of bare connects is capped at the broker.

Before: mosquitto kept a revoked identity's open session (its rights left the ACL, its certificate
the CRL, but the connection stayed up: "a revoked app reconnects for ~1 s", and one that never
disconnects keeps its session), and connections were bounded by time, not count (30k bare
connects held 18,198 of 20,000 descriptors). Now removing an identity from the ACL closes its
session at once (``MosquittoBroker.close_sessions``: a short-lived certificate under its name
takes the session over and leaves), and mosquitto holds at most ``max_connections``.

A real mosquitto with TLS, client certificates, CRL and ACL, as the fog runs it; the attackers
are a plain paho client holding a real certificate and raw TCP sockets that never handshake.
"""
from __future__ import annotations

import os
import queue
import socket
import ssl
import statistics
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest
from cryptography import x509

from runtime.broker import BrokerConfig, MosquittoBroker, acl_for, find_mosquitto
from runtime.mqtt import Inbound, MqttClient
from runtime.pki import SiteCA, TlsBundle
from runtime.topics import Topics

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

T = Topics("s1")
ROLES = {"fog-1": "fog", "dev-a": "device", "dev-r": "device", "app-r": "app"}
CAP = 64


@dataclass
class Site:
    ca: SiteCA
    tls_dir: Path
    bundles: dict[str, TlsBundle]
    broker: MosquittoBroker


@pytest.fixture
def site(tmp_path: Path) -> Iterator[Site]:
    ca = SiteCA.load_or_create(tmp_path / "pki", "s1")
    tls_dir = tmp_path / "broker"
    ca.ensure_server_cert(tls_dir, ["localhost"], ["127.0.0.1"])
    (tls_dir / "ca.pem").write_bytes(ca.ca_pem)
    ca.write_crl(tls_dir / "crl.pem")
    bundles = {cn: ca.issue_bundle(tmp_path / cn, cn, role) for cn, role in ROLES.items()}
    b = MosquittoBroker(BrokerConfig(data_dir=tmp_path / "mqtt", tls_dir=tls_dir, acl=acl_for("s1", "fog-1", ROLES),
                                     persistence=False, max_message_bytes=1 << 20, max_connections=CAP)).start()
    b.session_closer = lambda name, target: ca.closer_bundle(target, name).tls()
    try:
        yield Site(ca, tls_dir, bundles, b)
    finally:
        b.kill()


class Paho:
    """A plain paho client (not our adapter) holding a real certificate; records its disconnects."""

    def __init__(self, site: Site, name: str) -> None:
        bundle = site.bundles[name]
        self.gone = threading.Event()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv311)
        self.c.tls_set(ca_certs=bundle.ca_file, certfile=bundle.cert_file, keyfile=bundle.key_file)
        self.c.tls_insecure_set(True)
        self.c.on_disconnect = lambda *a: self.gone.set()
        self.c.reconnect_delay_set(60, 60)  # it does not come back by itself: we watch the first session
        self.c.connect("127.0.0.1", site.broker.port, 30)
        self.c.loop_start()
        wait_for(self.c.is_connected, 10, f"{name} connected")

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


def _revoke(site: Site, name: str) -> None:
    """What the fog does when an identity is revoked: CRL, then the ACL without it."""
    serial = x509.load_pem_x509_certificate(Path(site.bundles[name].cert_file).read_bytes()).serial_number
    site.ca.revoke(serial, name, "test")
    site.ca.write_crl(site.tls_dir / "crl.next")
    assert site.broker.update_crl((site.tls_dir / "crl.next").read_bytes())
    assert site.broker.update_acl(acl_for("s1", "fog-1", {k: v for k, v in ROLES.items() if k != name}))


def _can_connect(site: Site, name: str) -> bool:
    bundle = site.bundles[name]
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=name, protocol=mqtt.MQTTv311)
    c.tls_set(ca_certs=bundle.ca_file, certfile=bundle.cert_file, keyfile=bundle.key_file)
    c.tls_insecure_set(True)
    try:
        if c.connect("127.0.0.1", site.broker.port, 30) != 0:
            return False
        c.loop_start()
        try:
            wait_for(c.is_connected, 3, "connected")
            return True
        except AssertionError:
            return False
        finally:
            c.disconnect()
            c.loop_stop()
    except (OSError, ssl.SSLError):
        return False


@pytest.mark.parametrize("name", ["dev-r", "app-r"])
def test_revocation_closes_the_live_session_at_once(site: Site, name: str) -> None:
    honest = MqttClient("dev-a", "127.0.0.1", site.broker.port, tls=site.bundles["dev-a"].tls())
    honest.start()
    assert honest.wait_connected(10), honest.last_error
    revoked = Paho(site, name)
    try:
        t0 = time.monotonic()
        _revoke(site, name)
        wait_for(revoked.gone.is_set, 10, f"{name}'s open session closed after its revocation")
        took = time.monotonic() - t0
        assert took < 5.0, f"closed {took:.1f} s after the revocation"
        wait_for(lambda: site.broker.closed_sessions >= 1, 10, "the broker counts the closed session")
        assert not _can_connect(site, name), "a revoked certificate connected again"
        assert honest.connected, "the honest device lost its session"
    finally:
        revoked.close()
        honest.stop()


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_a_flood_of_bare_connects_is_capped_and_devices_are_still_served(site: Site) -> None:
    """2,000 TCP connects that never handshake: mosquitto holds at most ``max_connections`` and the
    connected device's messages still reach the fog at once (round trips measured during the flood)."""
    got: queue.Queue[Inbound] = queue.Queue()
    fog = MqttClient("fog-1", "127.0.0.1", site.broker.port, tls=site.bundles["fog-1"].tls())
    fog.subscribe(T.device("dev-a", "STATE"), got.put)
    dev = MqttClient("dev-a", "127.0.0.1", site.broker.port, tls=site.bundles["dev-a"].tls())
    for c in (fog, dev):
        c.start()
        assert c.wait_connected(10), c.last_error
    pid = site.broker.proc.pid if site.broker.proc is not None else site.broker.pid
    assert pid is not None
    base = _fds(pid)

    def round_trip(i: int) -> float:
        t0 = time.monotonic()
        dev.publish(T.device("dev-a", "STATE"), b"%d" % i, qos=1)
        while True:
            m = got.get(timeout=5)
            if m.payload == b"%d" % i:
                return time.monotonic() - t0

    wait_for(lambda: round_trip(-1) >= 0, 10, "the fog hears the device", retry_on=(queue.Empty,))
    flood: list[socket.socket] = []
    try:
        for _ in range(2000):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", site.broker.port))
            flood.append(s)
        wait_for(lambda: _fds(pid) >= base + CAP // 2, 10, "the broker accepted part of the flood")
        trips = [round_trip(i) for i in range(20)]
        held = _fds(pid)
        assert held <= CAP + 16, f"the broker holds {held} descriptors during the flood (cap {CAP})"
        assert max(trips) < 1.0, f"device round trips during the flood: p50 {statistics.median(trips):.3f} s, " \
                                 f"max {max(trips):.3f} s"
        print(f"bare connects 2000, broker fds {held} (cap {CAP}), device round trip during the flood: "
              f"p50 {statistics.median(trips) * 1e3:.1f} ms, max {max(trips) * 1e3:.1f} ms")
    finally:
        for s in flood:
            s.close()
    # the flood gone, a device connects again
    again = MqttClient("dev-r", "127.0.0.1", site.broker.port, tls=site.bundles["dev-r"].tls())
    again.start()
    try:
        assert again.wait_connected(15), again.last_error
    finally:
        again.stop()
        dev.stop()
        fog.stop()
