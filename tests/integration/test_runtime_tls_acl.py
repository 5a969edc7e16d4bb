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

from runtime.broker import BrokerConfig, MosquittoBroker, acl_text, find_mosquitto
from runtime.mqtt import Inbound, MqttClient, TlsConfig
from runtime.pki import SitePki, load_site_pki, make_site_pki
from runtime.topics import Topics

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed"),
]

T = Topics("s1")
MARK = b"__marker__"
LIVE = b"__live__"  # subscription probes; ignored (late copies included) by drain_until_marker


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> SitePki:
    return make_site_pki(tmp_path_factory.mktemp("pki"), ["dev-a", "dev-b"], fog_ids=("fog-1",),
                         cloud_ids=("cloud-1",))


@pytest.fixture(scope="module")
def broker(pki: SitePki, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    b = MosquittoBroker(BrokerConfig(data_dir=tmp_path_factory.mktemp("tls-broker"), tls_dir=pki.dir,
                                     acl=True, persistence=False)).start()
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
           subs: dict[str, "queue.Queue[Inbound]"] | None = None) -> MqttClient:
    c = MqttClient(name, broker.host, broker.port, tls=tls)
    for topic, q in (subs or {}).items():
        c.subscribe(topic, q.put)
    made.append(c)
    c.start()
    assert c.wait_connected(10), f"{name} could not connect over TLS"
    return c


def drain_until_marker(q: "queue.Queue[Inbound]", timeout: float = 5.0, marker: bytes = MARK) -> list[Inbound]:
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


def wait_live(q: "queue.Queue[Inbound]", publisher: MqttClient, topic: str) -> None:
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


def test_pki_files_and_certificates(pki: SitePki) -> None:
    for key in [pki.ca_key, pki.broker_key, *(k for _, k in pki.clients.values())]:
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
    broker = x509.load_pem_x509_certificate(pki.broker_cert.read_bytes())
    san = broker.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "127.0.0.1" in [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
    assert "localhost" in san.get_values_for_type(x509.DNSName)
    for cn, (cert_path, _) in pki.clients.items():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        assert cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value == cn
        ca = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes())
        cert.verify_directly_issued_by(ca)
    again = load_site_pki(pki.dir)
    assert again.clients == pki.clients and again.fogs == ("fog-1",) and again.devices == ("dev-a", "dev-b")
    text = acl_text(again.fogs, again.clouds)
    assert "user fog-1" in text and "user cloud-1" in text


# ---------------------------------------------------------------- TLS


def test_client_without_certificate_is_refused(pki: SitePki, broker: MosquittoBroker,
                                               made: list[MqttClient]) -> None:
    c = MqttClient("anon", broker.host, broker.port, tls=TlsConfig(ca_file=str(pki.ca_cert)))
    made.append(c)
    c.start()
    assert not c.wait_connected(1.5)


def test_plain_tcp_is_refused(broker: MosquittoBroker, made: list[MqttClient]) -> None:
    c = MqttClient("plain", broker.host, broker.port)
    made.append(c)
    c.start()
    assert not c.wait_connected(1.5)


def test_certificate_from_another_ca_is_refused(broker: MosquittoBroker, made: list[MqttClient],
                                                tmp_path: Path, pki: SitePki) -> None:
    rogue = make_site_pki(tmp_path / "rogue", ["dev-a"], fog_ids=(), cloud_ids=())
    cert, key = rogue.clients["dev-a"]
    c = MqttClient("dev-a", broker.host, broker.port,
                   tls=TlsConfig(ca_file=str(pki.ca_cert), cert_file=str(cert), key_file=str(key)))
    made.append(c)
    c.start()
    assert not c.wait_connected(1.5)


def test_broker_certificate_is_checked_by_clients(pki: SitePki, broker: MosquittoBroker, tmp_path: Path) -> None:
    other = make_site_pki(tmp_path / "other", ["x"], fog_ids=(), cloud_ids=())
    ctx = ssl.create_default_context(cafile=str(other.ca_cert))
    import socket

    with socket.create_connection((broker.host, broker.port), timeout=5) as raw:
        with pytest.raises(ssl.SSLError):
            ctx.wrap_socket(raw, server_hostname="127.0.0.1")


# ---------------------------------------------------------------- ACL by delivery


def test_device_writes_only_under_its_own_prefix(pki: SitePki, broker: MosquittoBroker,
                                                 made: list[MqttClient]) -> None:
    q: queue.Queue[Inbound] = queue.Queue()
    client(made, "fog-1", broker, pki.tls("fog-1"), {"fogline/v1/#": q})
    a = client(made, "dev-a", broker, pki.tls("dev-a"))
    wait_live(q, a, T.device("dev-a", "STATE"))

    forbidden = [T.device("dev-b", leaf) for leaf in ("BIRTH", "STATE", "DEATH", "ACK", "CMD")]
    forbidden += [T.fog_state(), T.rebirth(), T.summary(), T.release(), "fogline/v1/s2/fog/CTL", "other/topic"]
    for topic in forbidden:
        a.publish(topic, b"forged", qos=1)
    a.publish(T.device("dev-a", "STATE"), b"own state", qos=1)
    a.publish(T.device("dev-a", "STATE"), MARK, qos=1)
    seen = drain_until_marker(q)
    assert [(m.topic, m.payload) for m in seen] == [(T.device("dev-a", "STATE"), b"own state")]


def test_device_data_plane_exceptions(pki: SitePki, broker: MosquittoBroker, made: list[MqttClient]) -> None:
    """docs/protocol.md: a hop forwards Activation to the next device, the last hop answers reply/{client}."""
    q: queue.Queue[Inbound] = queue.Queue()
    client(made, "fog-1", broker, pki.tls("fog-1"), {"fogline/v1/#": q})
    a = client(made, "dev-a", broker, pki.tls("dev-a"))
    wait_live(q, a, T.device("dev-a", "STATE"))
    a.publish(T.device("dev-b", "ACT"), b"activation", qos=1)
    a.publish(T.reply("client-7"), b"result", qos=1)
    a.publish(T.device("dev-a", "STATE"), MARK, qos=1)
    seen = drain_until_marker(q)
    assert [m.topic for m in seen] == [T.device("dev-b", "ACT"), T.reply("client-7")]


def test_device_reads_only_its_own_commands(pki: SitePki, broker: MosquittoBroker, made: list[MqttClient]) -> None:
    q: queue.Queue[Inbound] = queue.Queue()
    fog = client(made, "fog-1", broker, pki.tls("fog-1"))
    # dev-a subscribes to everything; the broker must only deliver what it may read
    client(made, "dev-a", broker, pki.tls("dev-a"), {"fogline/v1/#": q})
    wait_live(q, fog, T.device("dev-a", "CMD"))
    fog.publish(T.device("dev-b", "CMD"), b"for b", qos=1)
    fog.publish(T.device("dev-b", "ACT"), b"for b", qos=1)
    fog.publish(T.reply("dev-b"), b"for b", qos=1)
    fog.publish(T.release(), b"release", qos=1)
    fog.publish(T.rebirth(), b"rebirth", qos=1)
    fog.publish(T.device("dev-a", "CMD"), b"for a", qos=1)
    fog.publish(T.device("dev-a", "CMD"), MARK, qos=1)
    seen = drain_until_marker(q)
    assert [(m.topic, m.payload) for m in seen] == [(T.rebirth(), b"rebirth"), (T.device("dev-a", "CMD"), b"for a")]


def test_cloud_rights(pki: SitePki, broker: MosquittoBroker, made: list[MqttClient]) -> None:
    q_fog: queue.Queue[Inbound] = queue.Queue()
    q_cloud: queue.Queue[Inbound] = queue.Queue()
    fog = client(made, "fog-1", broker, pki.tls("fog-1"), {"fogline/v1/#": q_fog})
    cloud = client(made, "cloud-1", broker, pki.tls("cloud-1"), {"fogline/v1/#": q_cloud})
    wait_live(q_fog, cloud, T.release())
    wait_live(q_cloud, fog, T.summary())
    cloud.publish(T.device("dev-a", "CMD"), b"forged cmd", qos=1)
    cloud.publish(T.fog_state(), b"forged state", qos=1)
    cloud.publish(T.control(), b"ctl", qos=1)
    cloud.publish(T.release(), MARK, qos=1)
    assert [m.topic for m in drain_until_marker(q_fog)] == [T.control()]
    fog.publish(T.device("dev-a", "STATE"), b"device detail", qos=1)
    fog.publish(T.reply("cloud-1"), b"answer", qos=1)
    fog.publish(T.summary(), b"__marker2__", qos=1)
    # the cloud reads fog/# (its own CTL included) and its replies, never device topics
    assert [m.topic for m in drain_until_marker(q_cloud, marker=b"__marker2__")] == [T.control(), T.reply("cloud-1")]
