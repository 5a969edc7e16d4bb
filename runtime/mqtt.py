"""The MQTT adapter: paho-mqtt 2.x (callback API v2, MQTT 5) behind a small, safe surface.

paho runs its network loop on its own thread, and anything slow inside a
paho callback stalls keepalives and acks for every subscription (and
``wait_for_publish`` inside one deadlocks). So the paho callbacks here only
enqueue; one worker thread per client runs the handlers. Subscriptions are
(re)made in ``on_connect`` so a reconnect restores them; reconnects back off
with jitter so a fleet that lost its broker does not return in lockstep.

Inbound size: each subscription may cap its payloads (``max_bytes``, default the
client-wide ``max_payload``); bigger ones are dropped on the network thread before
they are queued and counted in ``dropped["oversize"]``. paho reads a whole packet
into memory before ``on_message`` runs, so this bounds what is queued and handled,
not what is received: the broker's ``message_size_limit`` bounds that.

TLS: the broker certificate is verified against the CA with hostname checking on
(or against ``TlsConfig.server_hostname``), TLS 1.2 or newer. A handshake failure or
a CONNACK refusal (not authorized, bad credentials, banned) is fatal for the wait:
``wait_connected`` returns at once (``strict=True``, or ``start(wait_s=...)``, raise
a one-line ``LocalViolation``) and ``last_error`` says why.
"""
from __future__ import annotations

import collections
import logging
import queue
import random
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from .errors import LocalViolation
from .net import parse_hostport  # one parser of addresses, re-exported for its callers

__all__ = ["MqttClient", "Inbound", "Will", "TlsConfig", "PublishHandle", "parse_hostport", "tls_context"]

log = logging.getLogger(__name__)

MAX_PAYLOAD = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class Inbound:
    """A received message, stamped with the monotonic time it arrived."""

    topic: str
    payload: bytes
    received_at: float
    retain: bool = False
    response_topic: str | None = None
    correlation_data: bytes | None = None


@dataclass(frozen=True, slots=True)
class Will:
    topic: str
    payload: bytes
    qos: int = 1
    retain: bool = False
    delay_s: int = 0


@dataclass(frozen=True, slots=True)
class TlsConfig:
    """CA to verify the broker with, our client certificate, and the name the broker's certificate must carry.

    ``server_hostname`` (default: the host dialled) is for reaching a broker by an
    address its certificate does not name, e.g. a discovered IP with a DNS-name cert.
    """

    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None
    server_hostname: str | None = None


class _TlsContext(ssl.SSLContext):
    """A client context that can verify (and SNI) a fixed server name instead of the host paho dials."""

    fixed_server_hostname: str | None = None

    def wrap_socket(self, sock: Any, server_side: bool = False, do_handshake_on_connect: bool = True,
                    suppress_ragged_eofs: bool = True, server_hostname: str | bytes | None = None,
                    session: Any = None) -> ssl.SSLSocket:
        return super().wrap_socket(sock, server_side, do_handshake_on_connect, suppress_ragged_eofs,
                                   self.fixed_server_hostname or server_hostname, session)


def tls_context(tls: TlsConfig) -> ssl.SSLContext:
    """Client TLS context: CA-verified broker, hostname checked, TLS >= 1.2, our cert if given."""
    ctx = _TlsContext(ssl.PROTOCOL_TLS_CLIENT)  # CERT_REQUIRED and check_hostname by construction
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=tls.ca_file)
        if tls.cert_file:
            ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as exc:
        raise LocalViolation(f"TLS setup failed ({tls.ca_file}, {tls.cert_file}): {exc}") from None
    ctx.fixed_server_hostname = tls.server_hostname
    return ctx


class PublishHandle:
    """What a QoS>0 publish returns: wait for the broker's ack outside any callback."""

    __slots__ = ("_info", "_sent_at")

    def __init__(self, info: mqtt.MQTTMessageInfo) -> None:
        self._info = info
        self._sent_at = time.monotonic()

    @property
    def mid(self) -> int:
        return int(self._info.mid)

    @property
    def rc(self) -> int:
        return int(self._info.rc)

    def is_published(self) -> bool:
        return bool(self._info.is_published())

    def wait(self, timeout: float) -> bool:
        """True once acknowledged; False on timeout or when the message was not queued."""
        if self._info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            return False
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                self._info.wait_for_publish(timeout=max(0.0, deadline - time.monotonic()))
            except (ValueError, RuntimeError):
                time.sleep(0.01)  # not yet queued to the socket (offline); paho raises then
                continue
            return bool(self._info.is_published())
        try:
            return bool(self._info.is_published())
        except (ValueError, RuntimeError):
            return False  # published while offline (paho raises for MQTT_ERR_NO_CONN): not acknowledged


Handler = Callable[[Inbound], None]

# CONNACK reasons that retrying will not fix: config or credentials, not the broker's health.
_FATAL_CONNACK = frozenset({0x84, 0x85, 0x86, 0x87, 0x8A, 0x8C})  # protocol, client id, user/password,
#                                                                    not authorized, banned, auth method


@dataclass(frozen=True, slots=True)
class _Sub:
    qos: int
    handler: Handler
    max_bytes: int | None  # None: the client's max_payload
    direct: bool = False  # run on paho's network thread (see subscribe)


@dataclass
class _Counters:
    received: int = 0
    dropped_oversized: int = 0
    dropped_overflow: int = 0
    handler_errors: int = 0
    connects: int = 0
    disconnects: int = 0
    publish_failures: int = 0
    extra: dict[str, int] = field(default_factory=dict)


_STOP = object()


class MqttClient:
    """One MQTT 5 connection with a worker thread for handlers.

    ``dropped`` counts inbound messages dropped before any handler, by reason
    ("oversize", "overflow": the inbox was full); ``last_error`` is the latest
    connection failure, one line, or None.
    """

    def __init__(self, client_id: str, host: str = "127.0.0.1", port: int = 1883, *,
                 keepalive: int = 5, will: Will | None = None, session_expiry_s: int = 0,
                 clean_start: bool = True, max_queued: int = 10_000, inbox_size: int = 10_000,
                 tls: TlsConfig | None = None, username: str | None = None, password: str | None = None,
                 reconnect_min_s: float = 0.2, reconnect_max_s: float = 5.0, max_payload: int = MAX_PAYLOAD) -> None:
        self.client_id = client_id
        self.host, self.port = host, port
        self.keepalive = keepalive
        self.session_expiry_s = session_expiry_s
        self.clean_start = clean_start
        self.max_payload = max_payload  # default inbound limit of a subscription (see subscribe)
        self.counters = _Counters()
        self.dropped: collections.Counter[str] = collections.Counter()
        self.last_error: str | None = None
        self.on_connected: list[Callable[[], None]] = []  # run on the worker after each (re)connect
        self._reconnect = (reconnect_min_s, reconnect_max_s)
        self._subs: dict[str, _Sub] = {}
        self._sub_mids: dict[int, str] = {}  # SUBSCRIBE packet id -> filter, until its SUBACK
        self.refused_subscriptions: dict[str, int] = {}  # filter -> refusals in a row (retried)
        self._granted: set[str] = set()  # filters the broker accepted on this connection
        # Read on the network thread: replaced whole (routes first), never mutated in place.
        self._routes: tuple[tuple[str, _Sub], ...] = ()
        self._route_cache: dict[str, _Sub | None] = {}
        self._inbox: queue.Queue[Any] = queue.Queue(maxsize=inbox_size)
        self._connected = threading.Event()
        self._state = threading.Condition()  # wakes wait_connected: connected, refused for good, stopped
        self._fatal: str | None = None  # a failure retrying will not fix, until the next CONNACK success
        self._connack_seen = False  # on the current socket
        self._log_error: str | None = None  # paho's last error log line while not connected
        self._stopped = False
        self._rng = random.Random()
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                                   protocol=mqtt.MQTTv5)
        self._client.max_queued_messages_set(max_queued)
        self._client.max_inflight_messages_set(100)
        # paho annotates the delays as int; it adds and sleeps them as they are (floats work)
        self._client.reconnect_delay_set(reconnect_min_s, reconnect_max_s)  # type: ignore[arg-type]
        if username is not None:
            self._client.username_pw_set(username, password)
        if tls is not None:
            self._client.tls_set_context(tls_context(tls))
        if will is not None:
            self.set_will(will)
        c = self._client
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_socket_open = self._on_socket_open
        c.on_connect_fail = self._on_connect_fail
        c.on_subscribe = self._on_subscribe
        c.on_log = self._on_log  # only while not connected: paho formats a line per packet for it
        self._worker = threading.Thread(target=self._run, name=f"mqtt-{client_id}", daemon=True)

    # ------------------------------------------------------------ config

    def set_will(self, will: Will) -> None:
        """Set the Last Will for the next connection (e.g. with a new connect epoch)."""
        props = None
        if will.delay_s:
            props = Properties(PacketTypes.WILLMESSAGE)
            props.WillDelayInterval = will.delay_s
        self._client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain, properties=props)

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1, max_bytes: int | None = None,
                  *, direct: bool = False) -> None:
        """Remember a subscription; it is (re)made on every connect.

        Payloads over ``max_bytes`` (default: the client's ``max_payload``) are dropped and
        counted before queueing. The first subscription whose filter matches a topic routes it.
        ``direct``: the handler runs on paho's network thread, skipping the worker's queue and one
        thread wake-up per message (the data plane's latency, issue 32); it must only hand the
        message on (no blocking, no signature checks) or it stalls every read and ack.
        """
        self._subs[topic_filter] = _Sub(qos, handler, max_bytes, direct)
        self._reroute()
        if self._connected.is_set():
            self._subscribe_now(topic_filter, qos)

    def _subscribe_now(self, topic_filter: str, qos: int) -> None:
        rc, mid = self._client.subscribe(topic_filter, qos=qos)
        if rc == mqtt.MQTT_ERR_SUCCESS and mid is not None:
            self._sub_mids[mid] = topic_filter

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any,
                      properties: Any) -> None:
        """A refused subscription (e.g. our ACL entry is not loaded yet) is retried with backoff."""
        tf = self._sub_mids.pop(mid, None)
        if tf is None or not any(getattr(rc, "is_failure", False) for rc in reason_codes):
            if tf is not None:
                self.refused_subscriptions.pop(tf, None)
                with self._state:
                    self._granted.add(tf)
                    self._state.notify_all()
            return
        n = self.refused_subscriptions.get(tf, 0) + 1
        self.refused_subscriptions[tf] = n
        self.dropped["subscription refused"] += 1
        if n == 1:
            log.warning("%s: the broker refused the subscription %s (%s); retrying", self.client_id, tf,
                        reason_codes[0])
        timer = threading.Timer(min(30.0, 0.25 * 2 ** min(n, 7)), self._retry_subscription, args=(tf,))
        timer.daemon = True
        timer.start()

    def _retry_subscription(self, tf: str) -> None:
        sub = self._subs.get(tf)
        if sub is not None and not self._stopped and self._connected.is_set():
            self._subscribe_now(tf, sub.qos)

    def resubscribe(self, topic_filter: str) -> None:
        """Subscribe again: the broker re-sends the retained message (e.g. one our ACL hid at first)."""
        sub = self._subs.get(topic_filter)
        if sub is not None and self._connected.is_set():
            self._subscribe_now(topic_filter, sub.qos)

    def _reroute(self) -> None:
        self._routes = tuple(self._subs.items())
        self._route_cache = {}

    # ------------------------------------------------------------ lifecycle

    def start(self, *, wait_s: float | None = None) -> None:
        """Connect in the background; with ``wait_s``, block until connected or raise ``LocalViolation``."""
        props = Properties(PacketTypes.CONNECT)
        if self.session_expiry_s:
            props.SessionExpiryInterval = self.session_expiry_s
        self._worker.start()
        self._client.connect_async(self.host, self.port, keepalive=self.keepalive,
                                   clean_start=self.clean_start, properties=props)
        self._client.loop_start()
        if wait_s is not None:
            self.wait_connected(wait_s, strict=True)

    def wait_connected(self, timeout: float, *, strict: bool = False) -> bool:
        """True once connected; False after ``timeout``, or at once when refused for good (see ``last_error``).

        With ``strict``, raise a one-line ``LocalViolation`` instead of returning False.
        """
        with self._state:
            self._state.wait_for(lambda: self._connected.is_set() or self._fatal is not None or self._stopped,
                                 timeout)
            if self._connected.is_set():
                return True
            fatal = self._fatal
        if strict:
            where = f"{self.client_id} -> {self.host}:{self.port}"
            if fatal is not None:
                raise LocalViolation(f"MQTT {where}: {fatal}")
            why = f": {self.last_error}" if self.last_error else ""
            raise LocalViolation(f"MQTT {where}: not connected within {timeout:g} s{why}")
        return False

    def wait_subscribed(self, topic_filter: str, timeout: float) -> bool:
        """True once the broker granted ``topic_filter`` on the current connection (a refusal is retried)."""
        with self._state:
            return self._state.wait_for(lambda: topic_filter in self._granted or self._stopped, timeout) \
                and topic_filter in self._granted

    def _set_error(self, text: str, *, fatal: bool) -> None:
        """Record a connection failure (any thread); a fatal one wakes ``wait_connected``."""
        text = " ".join(text.split())[:300]
        self.last_error = text
        if fatal:
            with self._state:
                self._fatal = text
                self._state.notify_all()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def stop(self, *, disconnect: bool = True) -> None:
        """Stop; ``disconnect=False`` drops the socket so the broker sends the Will."""
        if self._stopped:
            return
        self._stopped = True
        with self._state:
            self._state.notify_all()
        if disconnect:
            try:
                self._client.disconnect()
            except Exception:
                log.debug("disconnect failed", exc_info=True)
        else:
            sock = self._client.socket()
            if isinstance(sock, socket.socket):  # TCP or TLS: paho dials no websockets here
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._client.loop_stop()
        self._inbox.put(_STOP)
        if threading.current_thread() is not self._worker and self._worker.ident is not None:
            self._worker.join(timeout=5)  # (ident is None: never started, nothing to join)

    # ------------------------------------------------------------ publish

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False,
                response_topic: str | None = None, correlation_data: bytes | None = None) -> PublishHandle:
        props = None
        if response_topic or correlation_data:
            props = Properties(PacketTypes.PUBLISH)
            if response_topic:
                props.ResponseTopic = response_topic
            if correlation_data:
                props.CorrelationData = correlation_data
        info = self._client.publish(topic, payload, qos=qos, retain=retain, properties=props)
        if info.rc not in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            self.counters.publish_failures += 1
        return PublishHandle(info)

    # ------------------------------------------------------------ paho callbacks (network thread)

    def _on_socket_open(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._connack_seen = False
        self._log_error = None
        try:  # paho never sets TCP_NODELAY; small QoS1 acks would wait on Nagle
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):
            pass

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any,
                    properties: Any) -> None:
        self._connack_seen = True
        if reason_code.is_failure:
            log.warning("%s: connection refused: %s", self.client_id, reason_code)
            self._set_error(f"the broker refused the connection: {reason_code}",
                            fatal=getattr(reason_code, "value", 0) in _FATAL_CONNACK)
            return
        client.on_log = None  # connected: no more per-packet log formatting for us
        self.counters.connects += 1
        for topic_filter, sub in self._routes:
            self._subscribe_now(topic_filter, sub.qos)
        with self._state:
            self._fatal = None
            self._log_error = None
            self._connected.set()
            self._state.notify_all()
        self._inbox.put(("connected", None))

    def _on_connect_fail(self, client: mqtt.Client, userdata: Any) -> None:
        # paho calls this from inside its ``except OSError`` block, so the cause is still current
        exc = sys.exc_info()[1]
        if isinstance(exc, ssl.SSLCertVerificationError):
            self._set_error(f"TLS handshake failed: {exc.verify_message or exc}", fatal=True)
        elif isinstance(exc, ssl.SSLError):
            self._set_error(f"TLS handshake failed: {exc.reason or exc}", fatal=True)
        elif isinstance(exc, ConnectionRefusedError):
            self._set_error("connection refused (is the broker running?)", fatal=False)
        elif exc is not None:
            self._set_error(f"cannot connect: {type(exc).__name__}: {exc}", fatal=False)
        else:
            self._set_error("cannot connect", fatal=False)

    def _on_log(self, client: mqtt.Client, userdata: Any, level: int, buf: str) -> None:
        if level == mqtt.MQTT_LOG_ERR:
            self._log_error = buf

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any,
                       properties: Any) -> None:
        self._connected.clear()
        with self._state:
            self._granted.clear()
        client.on_log = self._on_log
        self.counters.disconnects += 1
        if not self._connack_seen and not self._stopped:
            # Lost before CONNACK: with TLS 1.3 a refused client certificate shows up here, as an alert
            # on the first read after the handshake; anything else (a reset, EOF) may be transient.
            cause = self._log_error or str(reason_code)
            self._set_error(f"connection lost before CONNACK: {cause}", fatal="[SSL" in cause)
        lo, hi = self._reconnect
        # jitter the backoff floor so reconnecting clients spread out
        client.reconnect_delay_set(lo * (0.5 + self._rng.random()), hi)  # type: ignore[arg-type]

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        topic = msg.topic
        sub = self._route(topic)
        limit = sub.max_bytes if sub is not None and sub.max_bytes is not None else self.max_payload
        if len(msg.payload) > limit:
            self.counters.dropped_oversized += 1
            self.dropped["oversize"] += 1
            log.debug("%s: dropped %d bytes on %s (limit %d)", self.client_id, len(msg.payload), topic, limit)
            return
        props = getattr(msg, "properties", None)
        payload = msg.payload if isinstance(msg.payload, bytes) else bytes(msg.payload)
        inbound = Inbound(topic, payload, time.monotonic(), bool(msg.retain),
                          getattr(props, "ResponseTopic", None) if props else None,
                          getattr(props, "CorrelationData", None) if props else None)
        if sub is not None and sub.direct:
            self.counters.received += 1
            try:
                sub.handler(inbound)
            except Exception:
                self.counters.handler_errors += 1
                log.exception("%s: direct handler failed for %s", self.client_id, topic)
            return
        try:
            self._inbox.put_nowait(("msg", inbound, sub.handler if sub is not None else None))
        except queue.Full:
            self.counters.dropped_overflow += 1
            self.dropped["overflow"] += 1

    def _route(self, topic: str) -> _Sub | None:
        """The subscription that handles ``topic`` (network thread; reads snapshots only)."""
        # Matching every filter per message shows in the fog's ingest profile; topics repeat
        # (one per device and leaf), so remember the answer until the subscriptions change.
        cache = self._route_cache  # before _routes: subscribe() replaces _routes first
        try:
            return cache[topic]
        except KeyError:
            pass
        found = None
        for topic_filter, sub in self._routes:
            if mqtt.topic_matches_sub(topic_filter, topic):
                found = sub
                break
        if len(cache) >= 100_000:
            cache.clear()
        cache[topic] = found
        return found

    # ------------------------------------------------------------ worker

    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            kind, value = item[0], item[1]
            try:
                if kind == "connected":
                    for hook in list(self.on_connected):
                        hook()
                    continue
                self.counters.received += 1
                handler = item[2]
                if handler is not None:
                    handler(value)
            except Exception:
                self.counters.handler_errors += 1
                log.exception("%s: handler failed for %s", self.client_id,
                              getattr(value, "topic", kind))
