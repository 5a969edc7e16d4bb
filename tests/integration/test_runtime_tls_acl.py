"""TLS with per-client certificates and the identity-scoped ACL, checked by delivery.

A SUBACK or PUBACK says nothing (mosquitto grants a forbidden subscription and
silently drops a forbidden publish), so every check publishes the forbidden
message first and an allowed marker after it on the same connection, and
asserts the forbidden one had not arrived when the marker did.
"""
from __future__ import annotations

import queue
import ssl
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from runtime.broker import BrokerConfig, MosquittoBroker, acl_for, find_mosquitto
from runtime.mqtt import Inbound, MqttClient, TlsConfig
from runtime.pki import SiteCA, TlsBundle
from runtime.topics import Topics

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed"),
]

T = Topics("s1")
MARK = b"__marker__"
LIVE = b"__live__"  # subscription probes; ignored (late copies included) by drain_until_marker


ROLES = {"fog-1": "fog", "dev-a": "device", "dev-b": "device", "cloud-1": "coordinator", "op-1": "operator",
         "app-1": "app"}


class Pki:
    """A site CA with one client bundle per identity (as ``fogline broker`` and enrolment make them)."""

    def __init__(self, root: Path) -> None:
        self.dir = root
        self.ca = SiteCA.load_or_create(root / "pki", "s1")
        self.tls_dir = root / "broker"
        self.ca.ensure_server_cert(self.tls_dir, ["localhost"], ["127.0.0.1"])
        (self.tls_dir / "ca.pem").write_bytes(self.ca.ca_pem)
        self.ca.write_crl(self.tls_dir / "crl.pem")
        self.bundles = {cn: self.ca.issue_bundle(root / cn, cn, role) for cn, role in ROLES.items()}

    def tls(self, cn: str) -> TlsConfig:
        return self.bundles[cn].tls()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def broker(pki: Pki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    b = MosquittoBroker(BrokerConfig(data_dir=tmp_path_factory.mktemp("tls-broker"), tls_dir=pki.tls_dir,
                                     acl=acl_for("s1", "fog-1", ROLES), persistence=False,
                                     max_message_bytes=1 << 20)).start()
    try:
        yield b
    finally:
        b.kill()


@pytest.fixture
def made() -> Iterator[list[MqttClient]]:
    clients: list[MqttClient] = []
    yield clients
    for c in clients:
        c.stop()


def client(made: list[MqttClient], name: str, broker: MosquittoBroker, tls: TlsConfig,
           subs: dict[str, queue.Queue[Inbound]] | None = None) -> MqttClient:
    c = MqttClient(name, broker.host, broker.port, tls=tls)
    for topic, q in (subs or {}).items():
        c.subscribe(topic, q.put)
    made.append(c)
    c.start()
    assert c.wait_connected(10), f"{name} could not connect over TLS"
    return c


def drain_until_marker(q: queue.Queue[Inbound], timeout: float = 5.0, marker: bytes = MARK) -> list[Inbound]:
    seen = []
    deadline = time.monotonic() + timeout
    while True:
        try:
            msg = q.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise AssertionError(f"marker never arrived; got {[m.topic for m in seen]}") from None
        if msg.payload == marker:
            return seen
        if msg.payload not in (LIVE, MARK, b"__marker2__"):
            seen.append(msg)


def wait_live(q: queue.Queue[Inbound], publisher: MqttClient, topic: str) -> None:
    """Publish probes on an allowed topic until one arrives: the subscription is live."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        publisher.publish(topic, LIVE, qos=1)
        try:
            while q.get(timeout=0.2).payload != LIVE:
                pass
        except queue.Empty:
            continue
        return
    raise AssertionError("subscription never became live")


# ---------------------------------------------------------------- pki


def test_pki_files_and_certificates(pki: Pki) -> None:
    keys = [pki.dir / "pki" / "ca.key", pki.tls_dir / "broker.key", *(Path(b.key_file) for b in pki.bundles.values())]
    for key in keys:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    broker = x509.load_pem_x509_certificate((pki.tls_dir / "broker.pem").read_bytes())
    san = broker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    ca = x509.load_pem_x509_certificate(pki.ca.ca_pem)
    for cn, bundle in pki.bundles.items():
        cert = x509.load_pem_x509_certificate(Path(bundle.cert_file).read_bytes())
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == cn
        assert cert.subject.get_attributes_for_oid(x509.NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == ROLES[cn]
        cert.verify_directly_issued_by(ca)
    assert TlsBundle.load(pki.dir / "dev-a").cert_file == pki.bundles["dev-a"].cert_file
    text = acl_for("s1", "fog-1", ROLES)
    assert "user fog-1" in text and "user cloud-1" in text and "pattern" not in text


# ---------------------------------------------------------------- TLS


def test_client_without_certificate_is_refused(pki: Pki, broker: MosquittoBroker,
                                               made: list[MqttClient]) -> None:
    c = MqttClient("anon", broker.host, broker.port, tls=TlsConfig(ca_file=pki.bundles["dev-a"].ca_file))
    made.append(c)
    c.start()
    assert not c.wait_connected(1.5)


def test_plain_tcp_is_refused(broker: MosquittoBroker, made: list[MqttClient]) -> None:
    c = MqttClient("plain", broker.host, broker.port)
    made.append(c)
    c.start()
    assert not c.wait_connected(1.5)


def test_certificate_from_another_ca_is_refused(broker: MosquittoBroker, made: list[MqttClient],
                                                tmp_path: Path, pki: Pki) -> None:
    rogue = SiteCA.load_or_create(tmp_path / "rogue", "s1").issue_bundle(tmp_path / "rogue-a", "dev-a", "device")
    c = MqttClient("dev-a", broker.host, broker.port,
                   tls=TlsConfig(ca_file=pki.bundles["dev-a"].ca_file, cert_file=rogue.cert_file,
                                 key_file=rogue.key_file))
    made.append(c)
    c.start()
    assert not c.wait_connected(1.5)


def test_broker_certificate_is_checked_by_clients(pki: Pki, broker: MosquittoBroker, tmp_path: Path) -> None:
    other = SiteCA.load_or_create(tmp_path / "other", "s1")
    ctx = ssl.create_default_context(cadata=other.ca_pem.decode())
    import socket

    with socket.create_connection((broker.host, broker.port), timeout=5) as raw, pytest.raises(ssl.SSLError):
        ctx.wrap_socket(raw, server_hostname="127.0.0.1")


# ---------------------------------------------------------------- ACL by delivery


def test_device_writes_only_under_its_own_prefix(pki: Pki, broker: MosquittoBroker,
                                                 made: list[MqttClient]) -> None:
    q: queue.Queue[Inbound] = queue.Queue()
    client(made, "fog-1", broker, pki.tls("fog-1"), {"fogline/v1/#": q})
    a = client(made, "dev-a", broker, pki.tls("dev-a"))
    wait_live(q, a, T.device("dev-a", "STATE"))

    forbidden = [T.device("dev-b", leaf) for leaf in ("BIRTH", "STATE", "DEATH", "ACK", "CMD")]
    forbidden += [T.fog_state(), T.rebirth(), T.summary(), T.release("dev-a"), "fogline/v1/s2/fog/CTL/dev-a",
                  "other/topic"]
    for topic in forbidden:
        a.publish(topic, b"forged", qos=1)
    a.publish(T.device("dev-a", "STATE"), b"own state", qos=1)
    a.publish(T.device("dev-a", "STATE"), MARK, qos=1)
    seen = drain_until_marker(q)
    assert [(m.topic, m.payload) for m in seen] == [(T.device("dev-a", "STATE"), b"own state")]


def test_device_data_plane_exceptions(pki: Pki, broker: MosquittoBroker, made: list[MqttClient]) -> None:
    """A hop forwards relay frames to any device's ACT and answers only the fog (results are sealed),
    always under its own name: never as another device, never on a topic that names no sender."""
    q: queue.Queue[Inbound] = queue.Queue()
    client(made, "fog-1", broker, pki.tls("fog-1"), {"fogline/v1/#": q})
    a = client(made, "dev-a", broker, pki.tls("dev-a"))
    wait_live(q, a, T.device("dev-a", "STATE"))
    a.publish(T.activation("dev-b", "dev-a"), b"activation", qos=1)
    a.publish(T.activation("dev-b", "dev-b"), b"forged sender", qos=1)
    a.publish(T.activation("dev-b", "fog-1"), b"forged sender", qos=1)
    a.publish(f"{T.base}/dev/dev-b/ACT", b"no sender", qos=1)
    a.publish(T.result("fog-1", "dev-a"), b"result", qos=1)
    a.publish(T.result("fog-1", "dev-b"), b"forged sender", qos=1)
    a.publish(T.reply("fog-1"), b"no sender", qos=1)
    a.publish(T.reply("client-7"), b"forged result", qos=1)
    a.publish(T.reply("op-1"), b"forged result", qos=1)
    a.publish(T.device("dev-a", "STATE"), MARK, qos=1)
    seen = drain_until_marker(q)
    assert [m.topic for m in seen] == [T.activation("dev-b", "dev-a"), T.result("fog-1", "dev-a")]


def test_device_reads_only_its_own_commands(pki: Pki, broker: MosquittoBroker, made: list[MqttClient]) -> None:
    q: queue.Queue[Inbound] = queue.Queue()
    fog = client(made, "fog-1", broker, pki.tls("fog-1"))
    # dev-a subscribes to everything; the broker must only deliver what it may read
    client(made, "dev-a", broker, pki.tls("dev-a"), {"fogline/v1/#": q})
    wait_live(q, fog, T.device("dev-a", "CMD"))
    fog.publish(T.device("dev-b", "CMD"), b"for b", qos=1)
    fog.publish(T.activation("dev-b", "fog-1"), b"for b", qos=1)
    fog.publish(T.reply("dev-b"), b"for b", qos=1)
    fog.publish(T.release("cloud-1"), b"release", qos=1)
    fog.publish(T.rebirth(), b"rebirth", qos=1)
    fog.publish(T.device("dev-a", "CMD"), b"for a", qos=1)
    fog.publish(T.device("dev-a", "CMD"), MARK, qos=1)
    seen = drain_until_marker(q)
    assert [(m.topic, m.payload) for m in seen] == [(T.rebirth(), b"rebirth"), (T.device("dev-a", "CMD"), b"for a")]


def test_cloud_rights(pki: Pki, broker: MosquittoBroker, made: list[MqttClient]) -> None:
    q_fog: queue.Queue[Inbound] = queue.Queue()
    q_cloud: queue.Queue[Inbound] = queue.Queue()
    fog = client(made, "fog-1", broker, pki.tls("fog-1"), {"fogline/v1/#": q_fog})
    cloud = client(made, "cloud-1", broker, pki.tls("cloud-1"), {"fogline/v1/#": q_cloud})
    wait_live(q_fog, cloud, T.release("cloud-1"))
    wait_live(q_cloud, fog, T.summary())
    cloud.publish(T.device("dev-a", "CMD"), b"forged cmd", qos=1)
    cloud.publish(T.fog_state(), b"forged state", qos=1)
    cloud.publish(T.control("op-1"), b"ctl as another", qos=1)
    cloud.publish(f"{T.base}/fog/CTL", b"ctl naming no one", qos=1)
    cloud.publish(T.control("cloud-1"), b"ctl", qos=1)
    # releases only under its own name: never another's, never the old topic that named no sender
    cloud.publish(T.release("op-1"), b"release as another", qos=1)
    cloud.publish(f"{T.base}/cloud/RELEASE", b"release naming no one", qos=1)
    cloud.publish(T.release("cloud-1"), MARK, qos=1)
    assert [m.topic for m in drain_until_marker(q_fog)] == [T.control("cloud-1")]
    fog.publish(T.device("dev-a", "STATE"), b"device detail", qos=1)
    fog.publish(T.reply("op-1"), b"someone else's answer", qos=1)
    fog.publish(T.reply("cloud-1"), b"answer", qos=1)
    fog.publish(T.summary(), b"__marker2__", qos=1)
    # the coordinator reads the fog's STATE and SUMMARY and its own replies, never device topics
    assert [m.topic for m in drain_until_marker(q_cloud, marker=b"__marker2__")] == [T.reply("cloud-1")]


def test_operator_and_app_rights(pki: Pki, broker: MosquittoBroker, made: list[MqttClient]) -> None:
    q_fog: queue.Queue[Inbound] = queue.Queue()
    client(made, "fog-1", broker, pki.tls("fog-1"), {"fogline/v1/#": q_fog})
    op = client(made, "op-1", broker, pki.tls("op-1"))
    app = client(made, "app-1", broker, pki.tls("app-1"))
    wait_live(q_fog, op, T.control("op-1"))
    for c, name, other in ((app, "app-1", "op-1"), (op, "op-1", "app-1")):
        for topic in (T.device("dev-a", "CMD"), T.device("dev-a", "BIRTH"), T.release(name), T.summary(),
                      T.fog_state(), T.reply("fog-1"), T.control(other), T.infer(other), T.control("fog-1"),
                      f"{T.base}/fog/CTL", f"{T.base}/fog/INFER"):
            c.publish(topic, b"forged", qos=1)
        c.publish(T.control(name), b"ctl", qos=1)
        c.publish(T.infer(name), b"infer", qos=1)
        c.publish(T.control(name), MARK, qos=1)
        assert [(m.topic, m.payload) for m in drain_until_marker(q_fog)] == [
            (T.control(name), b"ctl"), (T.infer(name), b"infer")]


def test_oversized_publish_never_reaches_anyone(pki: Pki, broker: MosquittoBroker, made: list[MqttClient]) -> None:
    q: queue.Queue[Inbound] = queue.Queue()
    client(made, "fog-1", broker, pki.tls("fog-1"), {"fogline/v1/#": q})
    op = client(made, "op-1", broker, pki.tls("op-1"))
    wait_live(q, op, T.control("op-1"))
    op.publish(T.control("op-1"), b"x" * (2 << 20), qos=1)  # over the broker's message_size_limit
    time.sleep(0.5)
    op2 = op if op.connected else client(made, "op-1", broker, pki.tls("op-1"))
    op2.publish(T.control("op-1"), MARK, qos=1)
    assert drain_until_marker(q) == []
