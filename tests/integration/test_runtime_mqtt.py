"""runtime.mqtt + runtime.broker against a real mosquitto on 127.0.0.1.

Every wait is bounded; subprocesses and brokers are killed in teardown.
"""
from __future__ import annotations

import dataclasses
import os
import queue
import select
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.broker import BrokerConfig, MosquittoBroker, find_mosquitto
from runtime.errors import LocalViolation
from runtime.mqtt import Inbound, MqttClient, TlsConfig, Will, tls_context
from runtime.pki import SiteCA, TlsBundle

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed"),
]

REPO = Path(__file__).resolve().parents[2]


class Inbox:
    """Collects handler calls; ``get`` waits with a deadline instead of sleeping."""

    def __init__(self) -> None:
        self.q: queue.Queue[Inbound] = queue.Queue()

    def __call__(self, msg: Inbound) -> None:
        self.q.put(msg)

    def get(self, timeout: float) -> Inbound:
        try:
            return self.q.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"nothing arrived within {timeout} s") from None

    def until(self, predicate: callable[[Inbound], bool], timeout: float) -> list[Inbound]:  # type: ignore[valid-type]
        """Messages received up to and including the first that satisfies ``predicate``."""
        seen: list[Inbound] = []
        deadline = time.monotonic() + timeout
        while True:
            msg = self.get(max(0.0, deadline - time.monotonic()))
            seen.append(msg)
            if predicate(msg):  # type: ignore[misc]
                return seen


@pytest.fixture
def broker(mosquitto: MosquittoBroker) -> MosquittoBroker:
    """The shared ``mosquitto`` fixture of tests/integration/conftest.py (no persistence)."""
    return mosquitto


@pytest.fixture
def persistent_broker(tmp_path: Path) -> Iterator[MosquittoBroker]:
    """A mosquitto with persistence on (the restart test needs ``mosquitto.db``)."""
    b = MosquittoBroker(BrokerConfig(data_dir=tmp_path / "broker", persistence=True)).start()
    try:
        yield b
    finally:
        b.kill()


@pytest.fixture
def clients() -> Iterator[list[MqttClient]]:
    made: list[MqttClient] = []
    yield made
    for c in made:
        c.stop()


def connect(made: list[MqttClient], name: str, broker: MosquittoBroker, **kw: object) -> MqttClient:
    c = MqttClient(name, broker.host, broker.port, **kw)  # type: ignore[arg-type]
    made.append(c)
    return c


def started(c: MqttClient) -> MqttClient:
    c.start()
    assert c.wait_connected(10), f"{c.client_id} did not connect"
    return c


def subscribed(c: MqttClient, topic: str, probe_from: MqttClient) -> None:
    """Block until ``c``'s subscription to ``topic`` is live (a probe message arrives)."""
    seen = threading.Event()
    probe = topic.replace("#", "probe").replace("+", "probe")
    sub = c._subs[topic]
    inner = sub.handler

    def handler(msg: Inbound) -> None:
        if msg.payload == b"__probe__":
            seen.set()
        else:
            inner(msg)

    c._subs[topic] = dataclasses.replace(sub, handler=handler)  # no re-SUBSCRIBE: retained stays quiet
    c._reroute()
    deadline = time.monotonic() + 10
    while not seen.is_set() and time.monotonic() < deadline:
        probe_from.publish(probe, b"__probe__", qos=0)
        seen.wait(0.1)
    c._subs[topic] = sub
    c._reroute()
    assert seen.is_set(), f"subscription {topic} never became live"


# ---------------------------------------------------------------- (a) Will on kill -9

VICTIM = textwrap.dedent("""
    import sys, time
    from runtime.mqtt import MqttClient, Will
    c = MqttClient("victim", "127.0.0.1", int(sys.argv[1]), keepalive=5,
                   will=Will(sys.argv[2], b"victim is dead", qos=1))
    c.start()
    if not c.wait_connected(10):
        sys.exit(3)
    print("ready", flush=True)
    time.sleep(120)
""")


def _wait_line(proc: subprocess.Popen[bytes], timeout: float) -> bytes:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "subprocess printed nothing in time"
    return proc.stdout.readline()


def test_will_reaches_subscriber_within_1s_after_kill9(broker: MosquittoBroker, clients: list[MqttClient]) -> None:
    topic = "fogline/v1/s1/dev/victim/DEATH"
    inbox = Inbox()
    watcher = connect(clients, "watcher", broker)
    watcher.subscribe(topic, inbox)
    started(watcher)
    pub = started(connect(clients, "prober", broker))
    subscribed(watcher, topic, pub)
    proc = subprocess.Popen([sys.executable, "-c", VICTIM, str(broker.port), topic], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        assert _wait_line(proc, 20).strip() == b"ready"
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        msg = inbox.get(timeout=1.0)
        latency = time.monotonic() - t0
        assert msg.topic == topic and msg.payload == b"victim is dead"
        assert latency < 1.0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=5)


def test_clean_stop_sends_no_will_but_socket_drop_does(broker: MosquittoBroker, clients: list[MqttClient]) -> None:
    topic = "fogline/v1/s1/dev/+/DEATH"
    inbox = Inbox()
    watcher = connect(clients, "watcher", broker)
    watcher.subscribe(topic, inbox)
    started(watcher)
    pub = started(connect(clients, "prober", broker))
    subscribed(watcher, topic, pub)
    polite = started(connect(clients, "polite", broker, will=Will("fogline/v1/s1/dev/polite/DEATH", b"x")))
    rude = started(connect(clients, "rude", broker, will=Will("fogline/v1/s1/dev/rude/DEATH", b"y")))
    polite.stop()  # DISCONNECT: the broker discards the Will
    rude.stop(disconnect=False)  # socket dropped: the broker publishes it
    msg = inbox.get(timeout=2.0)
    assert msg.topic == "fogline/v1/s1/dev/rude/DEATH"
    with pytest.raises(AssertionError):
        inbox.get(timeout=0.3)


# ---------------------------------------------------------------- (b) QoS1 across a broker restart


def test_qos1_messages_survive_broker_restart(persistent_broker: MosquittoBroker,
                                              clients: list[MqttClient]) -> None:
    broker = persistent_broker
    topic = "fogline/v1/s1/dev/d1/STATE"
    got: set[int] = set()
    lock = threading.Lock()
    all_in = threading.Event()
    n_total = 400

    def on_msg(msg: Inbound) -> None:
        if msg.payload.startswith(b"__"):
            return
        with lock:
            got.add(int(msg.payload))
            if len(got) == n_total:
                all_in.set()

    # the subscriber comes back well after the publisher has flushed its backlog, so only
    # the broker's persisted session (subscription + queued QoS1 messages) can deliver it
    sub = connect(clients, "sub-persistent", broker, clean_start=False, session_expiry_s=300,
                  reconnect_min_s=1.5, reconnect_max_s=2.0)
    sub.subscribe(topic, on_msg, qos=1)
    started(sub)
    pub = started(connect(clients, "pub", broker, reconnect_min_s=0.1, reconnect_max_s=0.5))
    subscribed(sub, topic, pub)

    published = 0
    failures: list[str] = []
    down = threading.Event()
    during_outage: list[int] = []

    def publisher() -> None:
        nonlocal published
        pace = threading.Event()
        for i in range(n_total):
            try:
                pub.publish(topic, str(i).encode(), qos=1)
            except Exception as exc:  # noqa: BLE001 - the adapter must not raise offline
                failures.append(f"{i}: {type(exc).__name__}: {exc}")
            if down.is_set():
                during_outage.append(i)
            published = i + 1
            pace.wait(0.004)

    t = threading.Thread(target=publisher, daemon=True)
    t.start()
    deadline = time.monotonic() + 10
    while len(got) < 50 and time.monotonic() < deadline:
        all_in.wait(0.01)
    assert got, "nothing delivered before the restart"
    broker.stop()  # SIGTERM: mosquitto saves its persistence db
    down.set()
    mark = published
    while published < mark + 40 and t.is_alive():
        all_in.wait(0.01)
    broker.start()
    down.clear()
    t.join(timeout=20)
    assert not t.is_alive()
    assert not failures, failures[:3]
    assert during_outage, "the publisher never published while the broker was down"
    all_in.wait(timeout=20)
    missing = sorted(set(range(n_total)) - got)
    assert not missing, f"{len(missing)} lost, e.g. {missing[:10]}"


# ---------------------------------------------------------------- (d) reconnect: hook and subscriptions


def test_on_connected_runs_after_reconnect_and_subscriptions_return(
        broker: MosquittoBroker, clients: list[MqttClient]) -> None:
    topic = "fogline/v1/s1/fog/REBIRTH"
    inbox = Inbox()
    hooks: queue.Queue[int] = queue.Queue()
    c = connect(clients, "agent", broker, reconnect_min_s=0.1, reconnect_max_s=0.5)
    c.subscribe(topic, inbox)
    c.on_connected.append(lambda: hooks.put(c.counters.connects))
    started(c)
    assert hooks.get(timeout=5) == 1
    broker.kill()  # a crash: no persistence save, and the client loses its session
    broker.start()
    assert hooks.get(timeout=15) == 2
    pub = started(connect(clients, "fog", broker))
    pub.publish(topic, b"after restart", qos=1)
    assert inbox.get(timeout=5).payload == b"after restart"
    assert c.counters.disconnects >= 1


# ---------------------------------------------------------------- (e) oversized payloads, failing handlers


def test_oversized_inbound_is_dropped_and_counted(broker: MosquittoBroker, clients: list[MqttClient]) -> None:
    topic = "fogline/v1/s1/reply/c1"
    inbox = Inbox()
    c = connect(clients, "small", broker, max_payload=1000)
    c.subscribe(topic, inbox)
    started(c)
    pub = started(connect(clients, "big", broker))
    subscribed(c, topic, pub)
    pub.publish(topic, b"x" * 1001)
    pub.publish(topic, b"y" * 1000)
    pub.publish(topic, b"end")
    seen = inbox.until(lambda m: m.payload == b"end", timeout=5)
    assert [len(m.payload) for m in seen] == [1000, 3]
    assert c.counters.dropped_oversized == 1
    assert c.dropped == {"oversize": 1}


def test_per_subscription_max_bytes(broker: MosquittoBroker, clients: list[MqttClient]) -> None:
    small, big = "fogline/v1/s1/dev/d1/STATE", "fogline/v1/s1/fog/DEPLOY"
    inbox = Inbox()
    c = connect(clients, "limits", broker, max_payload=1000)
    c.subscribe(small, inbox, max_bytes=100)
    c.subscribe(big, inbox)  # the client-wide default
    c.subscribe("fogline/v1/s1/blob/#", inbox, max_bytes=5000)  # above the default: the subscription wins
    started(c)
    pub = started(connect(clients, "sender", broker))
    for t in (small, big, "fogline/v1/s1/blob/#"):
        subscribed(c, t, pub)
    for topic, size in ((small, 101), (small, 100), (big, 101), (big, 1001), ("fogline/v1/s1/blob/x", 4000),
                        ("fogline/v1/s1/blob/x", 5001)):
        pub.publish(topic, b"x" * size)
    pub.publish(big, b"end")
    seen = inbox.until(lambda m: m.payload == b"end", timeout=5)
    assert [(m.topic, len(m.payload)) for m in seen] == [
        (small, 100), (big, 101), ("fogline/v1/s1/blob/x", 4000), (big, 3)]
    assert c.dropped == {"oversize": 3} and c.counters.dropped_oversized == 3


def test_handler_exception_is_counted_and_worker_goes_on(
        broker: MosquittoBroker, clients: list[MqttClient]) -> None:
    topic = "fogline/v1/s1/fog/INFER"
    inbox = Inbox()

    def handler(msg: Inbound) -> None:
        if msg.payload == b"boom":
            raise RuntimeError("handler bug")
        inbox(msg)

    c = connect(clients, "worker", broker)
    c.subscribe(topic, handler)
    started(c)
    pub = started(connect(clients, "client", broker))
    subscribed(c, topic, pub)
    for payload in (b"boom", b"one", b"boom", b"two"):
        pub.publish(topic, payload)
    seen = inbox.until(lambda m: m.payload == b"two", timeout=5)
    assert [m.payload for m in seen] == [b"one", b"two"]
    assert c.counters.handler_errors == 2
    # and the on_connected hook failing is counted the same way, without killing the worker
    assert c._worker.is_alive()


# ---------------------------------------------------------------- (f) TLS and refused connections: fail fast, one line


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site CA, the broker's files (``tls/``) and dev-a's bundle (``dev-a/``) under one directory."""
    root = tmp_path_factory.mktemp("pki")
    ca = SiteCA.load_or_create(root / "ca", "s1")
    ca.ensure_server_cert(root / "tls", ["localhost"], ["127.0.0.1"])
    (root / "tls" / "ca.pem").write_bytes(ca.ca_pem)
    ca.write_crl(root / "tls" / "crl.pem")
    ca.issue_bundle(root / "dev-a", "dev-a", "device")
    return root


@pytest.fixture(scope="module")
def tls_broker(pki: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[MosquittoBroker]:
    b = MosquittoBroker(BrokerConfig(data_dir=tmp_path_factory.mktemp("tls"), tls_dir=pki / "tls",
                                     persistence=False)).start()
    try:
        yield b
    finally:
        b.kill()


def _tls(pki: Path, *, cert: bool = True, ca: Path | None = None, server_hostname: str | None = None) -> TlsConfig:
    b = TlsBundle(pki / "dev-a")
    return TlsConfig(str(ca or b.ca_file), b.cert_file if cert else None, b.key_file if cert else None,
                     server_hostname)


def test_tls_context_verifies_hostname_and_needs_tls12(pki: Path) -> None:
    import ssl

    ctx = tls_context(_tls(pki))
    assert ctx.check_hostname and ctx.verify_mode == ssl.CERT_REQUIRED
    assert ctx.minimum_version >= ssl.TLSVersion.TLSv1_2
    with pytest.raises(LocalViolation, match="TLS setup failed"):
        tls_context(TlsConfig("/nonexistent/ca.pem"))


def test_tls_connects_and_server_hostname_overrides_the_dialled_host(
        pki: Path, tls_broker: MosquittoBroker, clients: list[MqttClient]) -> None:
    # the broker certificate names 127.0.0.1 and localhost: dialling the IP but checking "localhost" works...
    c = connect(clients, "dev-a", tls_broker, tls=_tls(pki, server_hostname="localhost"))
    c.start(wait_s=10)
    assert c.connected and c.last_error is None
    # ...and checking a name the certificate does not carry fails, although the IP alone would pass
    bad = connect(clients, "dev-a-2", tls_broker, tls=_tls(pki, server_hostname="evil.example"))
    t0 = time.monotonic()
    with pytest.raises(LocalViolation, match="TLS handshake failed: Hostname mismatch") as err:
        bad.start(wait_s=10)
    assert time.monotonic() - t0 < 5 and "\n" not in str(err.value)


@pytest.mark.parametrize("case,match", [
    ("broker cert from another CA", "TLS handshake failed: .*certificate"),
    ("no client certificate", r"\[SSL.*certificate required"),
])
def test_tls_failures_end_the_wait_with_one_line(pki: Path, tls_broker: MosquittoBroker,
                                                 clients: list[MqttClient], tmp_path: Path,
                                                 case: str, match: str) -> None:
    if case == "no client certificate":
        tls = _tls(pki, cert=False)
    else:
        rogue = SiteCA.load_or_create(tmp_path / "rogue", "s1")
        tls = _tls(pki, ca=rogue.dir / "ca.pem")
    c = connect(clients, "dev-a", tls_broker, tls=tls)
    c.start()
    t0 = time.monotonic()
    assert c.wait_connected(10) is False  # not strict: False, at once rather than after 10 s
    assert time.monotonic() - t0 < 5
    with pytest.raises(LocalViolation, match=match) as err:
        c.wait_connected(10, strict=True)
    assert "\n" not in str(err.value) and c.last_error is not None


class _NoAnonymous(MosquittoBroker):
    """A plain-TCP mosquitto that refuses every client (no password file, no anonymous)."""

    def write_config(self) -> Path:
        path = super().write_config()
        path.write_text(path.read_text().replace("allow_anonymous true", "allow_anonymous false"))
        return path


def test_connack_not_authorized_is_reported_not_waited_out(tmp_path: Path, clients: list[MqttClient]) -> None:
    b = _NoAnonymous(BrokerConfig(data_dir=tmp_path / "noanon", persistence=False)).start()
    try:
        c = connect(clients, "nobody", b)  # type: ignore[arg-type]
        t0 = time.monotonic()
        with pytest.raises(LocalViolation, match="refused the connection: Not authorized"):
            c.start(wait_s=10)
        assert time.monotonic() - t0 < 5
    finally:
        b.kill()


def test_a_broker_that_is_not_there_yet_is_waited_for(clients: list[MqttClient], tmp_path: Path) -> None:
    from runtime.broker import free_port

    port = free_port()
    c = MqttClient("early", "127.0.0.1", port, reconnect_min_s=0.1, reconnect_max_s=0.3)
    clients.append(c)
    c.start()
    with pytest.raises(LocalViolation, match=r"not connected within 0\.5 s: connection refused"):
        c.wait_connected(0.5, strict=True)  # a refused TCP connect is not fatal: keep trying
    b = MosquittoBroker(BrokerConfig(data_dir=tmp_path / "late", port=port, persistence=False)).start()
    try:
        assert c.wait_connected(10)
    finally:
        b.kill()
