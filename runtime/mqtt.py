"""The MQTT adapter: paho-mqtt 2.x (callback API v2, MQTT 5) behind a small, safe surface.

paho runs its network loop on its own thread, and anything slow inside a
paho callback stalls keepalives and acks for every subscription (and
``wait_for_publish`` inside one deadlocks). So the paho callbacks here only
enqueue; one worker thread per client runs the handlers. Subscriptions are
(re)made in ``on_connect`` so a reconnect restores them; reconnects back off
with jitter so a fleet that lost its broker does not return in lockstep.
"""
from __future__ import annotations

import logging
import queue
import random
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import paho.mqtt.client as mqtt
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

__all__ = ["MqttClient", "Inbound", "Will", "TlsConfig", "PublishHandle", "parse_hostport"]

log = logging.getLogger(__name__)

MAX_PAYLOAD = 16 * 1024 * 1024


def parse_hostport(text: str, default_port: int = 1883) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host:
        return text, default_port
    try:
        return host, int(port)
    except ValueError:
        raise ValueError(f"expected HOST:PORT, got {text!r}") from None


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
    ca_file: str
    cert_file: str | None = None
    key_file: str | None = None


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
        return bool(self._info.is_published())


Handler = Callable[[Inbound], None]


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
    """One MQTT 5 connection with a worker thread for handlers."""

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
        self.max_payload = max_payload
        self.counters = _Counters()
        self.on_connected: list[Callable[[], None]] = []  # run on the worker after each (re)connect
        self._reconnect = (reconnect_min_s, reconnect_max_s)
        self._subs: dict[str, tuple[int, Handler]] = {}
        self._route_cache: dict[str, Handler | None] = {}
        self._inbox: queue.Queue[Any] = queue.Queue(maxsize=inbox_size)
        self._connected = threading.Event()
        self._stopped = False
        self._rng = random.Random()
        self._client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id,
                                   protocol=mqtt.MQTTv5)
        self._client.max_queued_messages_set(max_queued)
        self._client.max_inflight_messages_set(100)
        self._client.reconnect_delay_set(reconnect_min_s, reconnect_max_s)
        if username is not None:
            self._client.username_pw_set(username, password)
        if tls is not None:
            self._client.tls_set(ca_certs=tls.ca_file, certfile=tls.cert_file, keyfile=tls.key_file)
        if will is not None:
            self.set_will(will)
        c = self._client
        c.on_connect = self._on_connect
        c.on_disconnect = self._on_disconnect
        c.on_message = self._on_message
        c.on_socket_open = self._on_socket_open
        self._worker = threading.Thread(target=self._run, name=f"mqtt-{client_id}", daemon=True)

    # ------------------------------------------------------------ config

    def set_will(self, will: Will) -> None:
        """Set the Last Will for the next connection (e.g. with a new connect epoch)."""
        props = None
        if will.delay_s:
            props = Properties(PacketTypes.WILLMESSAGE)
            props.WillDelayInterval = will.delay_s
        self._client.will_set(will.topic, will.payload, qos=will.qos, retain=will.retain, properties=props)

    def subscribe(self, topic_filter: str, handler: Handler, qos: int = 1) -> None:
        """Remember a subscription; it is (re)made on every connect."""
        self._subs[topic_filter] = (qos, handler)
        self._route_cache = {}
        if self._connected.is_set():
            self._client.subscribe(topic_filter, qos=qos)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        props = Properties(PacketTypes.CONNECT)
        if self.session_expiry_s:
            props.SessionExpiryInterval = self.session_expiry_s
        self._worker.start()
        self._client.connect_async(self.host, self.port, keepalive=self.keepalive,
                                   clean_start=self.clean_start, properties=props)
        self._client.loop_start()

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def stop(self, *, disconnect: bool = True) -> None:
        """Stop; ``disconnect=False`` drops the socket so the broker sends the Will."""
        if self._stopped:
            return
        self._stopped = True
        if disconnect:
            try:
                self._client.disconnect()
            except Exception:  # noqa: BLE001 - best effort on shutdown
                log.debug("disconnect failed", exc_info=True)
        else:
            sock = self._client.socket()
            if sock is not None:
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
        try:  # paho never sets TCP_NODELAY; small QoS1 acks would wait on Nagle
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):
            pass

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any,
                    properties: Any) -> None:
        if reason_code.is_failure:
            log.warning("%s: connection refused: %s", self.client_id, reason_code)
            return
        self.counters.connects += 1
        for topic_filter, (qos, _) in self._subs.items():
            client.subscribe(topic_filter, qos=qos)
        self._connected.set()
        self._inbox.put(("connected", None))

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any,
                       properties: Any) -> None:
        self._connected.clear()
        self.counters.disconnects += 1
        lo, hi = self._reconnect
        # jitter the backoff floor so reconnecting clients spread out
        client.reconnect_delay_set(lo * (0.5 + self._rng.random()), hi)

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        if len(msg.payload) > self.max_payload:
            self.counters.dropped_oversized += 1
            return
        props = getattr(msg, "properties", None)
        inbound = Inbound(msg.topic, msg.payload, time.monotonic(), bool(msg.retain),
                          getattr(props, "ResponseTopic", None) if props else None,
                          getattr(props, "CorrelationData", None) if props else None)
        try:
            self._inbox.put_nowait(("msg", inbound))
        except queue.Full:
            self.counters.dropped_overflow += 1

    # ------------------------------------------------------------ worker

    def _handler_for(self, topic: str) -> Handler | None:
        # Matching every filter per message shows in the fog's ingest profile; topics repeat
        # (one per device and leaf), so remember the answer until the subscriptions change.
        try:
            return self._route_cache[topic]
        except KeyError:
            pass
        found = None
        for topic_filter, (_, handler) in self._subs.items():
            if mqtt.topic_matches_sub(topic_filter, topic):
                found = handler
                break
        if len(self._route_cache) >= 100_000:
            self._route_cache.clear()
        self._route_cache[topic] = found
        return found

    def _run(self) -> None:
        while True:
            item = self._inbox.get()
            if item is _STOP:
                return
            kind, value = item
            try:
                if kind == "connected":
                    for hook in list(self.on_connected):
                        hook()
                    continue
                self.counters.received += 1
                handler = self._handler_for(value.topic)
                if handler is not None:
                    handler(value)
            except Exception:  # noqa: BLE001 - a bad handler must not kill the worker
                self.counters.handler_errors += 1
                log.exception("%s: handler failed for %s", self.client_id,
                              getattr(value, "topic", kind))
