"""Issue 20 finding 6 (enrolment half), the caps themselves: per peer, in total, and the head deadline.

The real enrolment server (TLS, its event loop) with small caps, and slow
clients from several loopback addresses (127.0.0.1-4) that complete TLS and
then send half a request head. Before: a ``ThreadingHTTPServer`` kept every
one of them, each on a thread, as long as a byte came every few seconds.
"""
from __future__ import annotations

import http.client
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fog_broker.enrolment import EnrolmentServer
from fog_broker.site import Site

pytestmark = pytest.mark.integration

CTX = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
CTX.check_hostname, CTX.verify_mode = False, ssl.CERT_NONE


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EnrolmentServer]:
    site = Site(tmp_path / "fog", site="default")
    tls_dir = site.broker_tls_dir(["localhost"], ["127.0.0.1"])
    srv = EnrolmentServer(site, "127.0.0.1", 0, tls_dir, max_connections=3, max_per_peer=2,
                          head_timeout_s=2.0).start()
    try:
        yield srv
    finally:
        srv.stop()
        site.close()


def _slow(srv: EnrolmentServer, source: str) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", srv.port), timeout=5, source_address=(source, 0))
    s = CTX.wrap_socket(raw)
    s.sendall(b"POST /v1/enroll HTTP/1.1\r\n")
    return s


def _until(pred: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.01)


def _closed_by_server(s: ssl.SSLSocket, timeout: float = 5.0) -> bool:
    s.settimeout(timeout)
    try:
        return s.recv(1) == b""
    except (ConnectionError, ssl.SSLError):
        return True
    except TimeoutError:
        return False


def test_caps_drop_the_oldest_slow_connection(server: EnrolmentServer) -> None:
    a1 = _slow(server, "127.0.0.1")
    a2 = _slow(server, "127.0.0.1")
    _until(lambda: server.open_connections == 2)
    a3 = _slow(server, "127.0.0.1")  # the peer's cap: its oldest goes
    assert _closed_by_server(a1)
    _until(lambda: server.counters["evicted:peer"] == 1 and server.open_connections == 2)
    b1 = _slow(server, "127.0.0.2")
    _until(lambda: server.open_connections == 3)
    c1 = _slow(server, "127.0.0.3")  # the total cap: the oldest of anyone's goes
    assert _closed_by_server(a2)
    _until(lambda: server.counters["evicted:total"] == 1 and server.open_connections == 3)
    # an honest request is answered at once, full or not
    t0 = time.monotonic()
    conn = http.client.HTTPSConnection("127.0.0.1", server.port, context=CTX, timeout=5,
                                       source_address=("127.0.0.4", 0))
    conn.request("GET", "/v1/ca")
    resp = conn.getresponse()
    assert resp.status == 200 and b"BEGIN CERTIFICATE" in resp.read()
    conn.close()
    assert time.monotonic() - t0 < 1.0
    # the head deadline ends the rest, however they trickle
    for s in (a3, b1, c1):
        assert _closed_by_server(s, timeout=10)
    _until(lambda: server.open_connections == 0)
    assert server.counters["rejected:slow"] >= 2
    for s in (a1, a2, a3, b1, c1):
        s.close()


def test_a_peer_whose_only_connection_is_dropped_is_still_counted(tmp_path: Path) -> None:
    """The total cap drops the sole connection of the very peer that connects again: the new one is tracked."""
    site = Site(tmp_path / "fog", site="default")
    srv = EnrolmentServer(site, "127.0.0.1", 0, site.broker_tls_dir(["localhost"], ["127.0.0.1"]),
                          max_connections=2, max_per_peer=5, head_timeout_s=30.0).start()
    try:
        a1 = _slow(srv, "127.0.0.1")
        _until(lambda: srv.open_connections == 1)
        b1 = _slow(srv, "127.0.0.2")
        _until(lambda: srv.open_connections == 2)
        a2 = _slow(srv, "127.0.0.1")
        assert _closed_by_server(a1)
        _until(lambda: srv.counters["evicted:total"] == 1)
        a2.close()
        b1.close()
        _until(lambda: srv.open_connections == 0)
    finally:
        srv.stop()
        site.close()


def test_oversized_head_and_bad_request_line_are_refused(server: EnrolmentServer) -> None:
    for payload, code in ((b"GET /v1/ca HTTP/1.1\r\nX: " + b"a" * 9000 + b"\r\n\r\n", b"431"),
                          (b"garbage\r\n\r\n", b"400")):
        raw = socket.create_connection(("127.0.0.1", server.port), timeout=5)
        s = CTX.wrap_socket(raw)
        s.sendall(payload)
        s.settimeout(5)
        got = b""
        try:
            while chunk := s.recv(4096):
                got += chunk
        except (ConnectionError, ssl.SSLError):
            pass
        s.close()
        assert got.startswith(b"HTTP/1.1 " + code), got[:80]
