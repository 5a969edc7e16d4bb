"""simulations.wan_relay: a WanLink with delay and loss, measured on real TCP through it.

Lower bounds only on time (a round trip is at least twice the one-way delay however busy the
machine), exact checks on bytes (order, content, the relay's held bytes against its cap) and on
the seeded losses (they follow from the seed and the stream's length alone)."""
from __future__ import annotations

import hashlib
import math
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from simulations.wan_relay import MSS, WanLink, plan_segments

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class _Server:
    """A TCP server on 127.0.0.1 running ``handle(conn)`` for each connection in its own thread."""

    def __init__(self, handle: Callable[[socket.socket], None]) -> None:
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.port = self._srv.getsockname()[1]
        self._handle = handle
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self._handle(conn)
            except OSError:
                pass

    def close(self) -> None:
        self._srv.close()


def _echo(conn: socket.socket) -> None:
    while data := conn.recv(65536):
        conn.sendall(data)


@pytest.fixture
def echo() -> Iterator[_Server]:
    srv = _Server(_echo)
    yield srv
    srv.close()


def _recv_exactly(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        b = s.recv(min(1 << 20, n - len(buf)))
        if not b:
            raise AssertionError(f"closed after {len(buf)} of {n} bytes")
        buf += b
    return bytes(buf)


def _round_trips(port: int, k: int) -> list[float]:
    with socket.create_connection(("127.0.0.1", port), timeout=20) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out = []
        for i in range(k):
            t0 = time.perf_counter()
            s.sendall(bytes([i]))
            assert _recv_exactly(s, 1) == bytes([i])
            out.append(time.perf_counter() - t0)
        return out


def test_plan_segments_keeps_order_and_stalls_a_lost_segment_and_what_follows() -> None:
    script = iter([0.9, 0.0, 0.9])  # segments at 0, MSS, 2*MSS: the second one is "lost"
    pieces = plan_segments(10.0, 0, 3 * MSS, last_due=0.0, delay_s=0.05, loss=0.1, rto_s=0.2,
                           draw=lambda: next(script))
    assert pieces == [(MSS, 10.05), (2 * MSS, pytest.approx(10.25))]
    # a later read never overtakes what is still waiting, and draws only at segment starts
    def never() -> float:
        raise AssertionError("no segment starts inside these bytes")
    later = plan_segments(10.01, 3 * MSS + 5, 10, last_due=10.25, delay_s=0.05, loss=0.1,
                          rto_s=0.2, draw=never)
    assert later == [(10, 10.25)]
    assert plan_segments(1.0, 7, 100, last_due=0.0, delay_s=0.0, loss=0.0, rto_s=0.2,
                         draw=lambda: 0.0) == [(100, 1.0)]


def test_delay_makes_each_round_trip_at_least_twice_the_one_way_delay(echo: _Server) -> None:
    plain, slow = WanLink(echo.port), WanLink(echo.port, delay_s=0.05)
    try:
        base = _round_trips(plain.port, 5)
        rtts = _round_trips(slow.port, 5)
        print(f"round trip: plain relay median {sorted(base)[2] * 1e3:.1f} ms, "
              f"50 ms each way median {sorted(rtts)[2] * 1e3:.1f} ms")
        assert min(rtts) >= 0.1, rtts
        assert sorted(rtts)[2] < 0.1 + 2.0, rtts  # generous: a busy machine, never a lost wake-up
        assert slow.delayed >= 10 and slow.up == 5 and slow.lost == 0 and slow.stall_s == 0
        assert plain.delayed == 0 and plain.up == plain.down == 5
    finally:
        plain.close()
        slow.close()


def test_a_multi_megabyte_stream_keeps_order_and_content_through_delay_and_loss(
        echo: _Server) -> None:
    data = random.Random(1).randbytes(3 << 20)
    link = WanLink(echo.port, delay_s=0.01, loss=0.002, seed=3)
    try:
        with socket.create_connection(("127.0.0.1", link.port), timeout=30) as s:
            sender = threading.Thread(target=s.sendall, args=(data,), daemon=True)
            sender.start()
            got = _recv_exactly(s, len(data))
            sender.join(10)
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
        assert link.up == link.down == len(data)
        assert link.lost > 0 and link.held_peak <= link.max_held
        print(f"3 MiB echoed: {link.lost} segments lost, {link.stall_s:.1f} s of stall")
    finally:
        link.close()


def _expected_losses(seed: int, k: int, direction: str, n: int, loss: float) -> int:
    rng = random.Random(f"{seed}/{k}/{direction}")
    return sum(rng.random() < loss for _ in range(math.ceil(n / MSS)))


def test_loss_stalls_the_stream_and_is_counted_reproducibly() -> None:
    n, loss, seed = 100_000, 0.05, 7
    want = _expected_losses(seed, 0, "up", n, loss)
    assert want > 0  # this seed loses some of the ~70 segments
    done = threading.Event()
    received: list[int] = []

    def sink(conn: socket.socket) -> None:
        got = 0
        while b := conn.recv(65536):
            got += len(b)
            if got >= n:
                received.append(got)
                done.set()

    srv = _Server(sink)
    counts = []
    try:
        for _ in range(2):
            done.clear()
            link = WanLink(srv.port, delay_s=0.005, loss=loss, seed=seed)
            try:
                t0 = time.perf_counter()
                with socket.create_connection(("127.0.0.1", link.port), timeout=20) as s:
                    s.sendall(b"z" * n)
                    assert done.wait(30), "the sink never got the whole stream"
                elapsed = time.perf_counter() - t0
                assert link.rto_s == 0.2  # the floor: 2 x a 10 ms round trip is less
                assert link.stall_s == pytest.approx(link.lost * link.rto_s)
                assert elapsed >= link.stall_s + 0.005, (elapsed, link.lost)  # stalls add up
                counts.append(link.lost)
            finally:
                link.close()
    finally:
        srv.close()
    print(f"{n} bytes at loss {loss}: {counts[0]} segments lost (seed {seed}), expected {want}")
    assert counts == [want, want]


def _kernel_buffers() -> int:
    """Most bytes the kernel's socket buffers on sender -> relay -> sink can take (each side's
    maximum send and receive buffer, autotuning included)."""
    most = 0
    for name in ("tcp_rmem", "tcp_wmem"):
        try:
            most += 2 * int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
        except (OSError, ValueError, IndexError):
            most += 2 * (32 << 20)
    return most


def test_a_fast_sender_meets_backpressure_and_the_relay_holds_at_most_its_cap() -> None:
    cap = 64 << 10
    n = ((_kernel_buffers() >> 20) + 8) << 20  # more than the kernel can buffer on the way
    go = threading.Event()
    digest: list[bytes] = []

    def slow_sink(conn: socket.socket) -> None:
        go.wait(60)  # reads nothing until told: every buffer on the way fills
        h, got = hashlib.sha256(), 0
        while got < n and (b := conn.recv(1 << 20)):
            h.update(b)
            got += len(b)
        digest.append(h.digest())

    srv = _Server(slow_sink)
    block = random.Random(2).randbytes(1 << 20)
    link = WanLink(srv.port, delay_s=0.002, max_held=cap)  # at most cap / delay_s B/s
    sent = [0]
    try:
        with socket.create_connection(("127.0.0.1", link.port), timeout=60) as s:
            def send() -> None:
                for _ in range(n // len(block)):
                    s.sendall(block)
                    sent[0] += len(block)

            sender = threading.Thread(target=send, daemon=True)
            sender.start()
            wait_for(lambda: link.held == cap, 30, "the relay holding its cap")
            time.sleep(0.5)  # measuring that the sender is held back, not only slowed
            before = sent[0]
            assert sender.is_alive() and before < n, f"{n >> 20} MiB sent into a stalled sink"
            assert link.held == cap and link.held_peak == cap
            print(f"stalled sink: relay holds {link.held} B (cap {cap}), sender blocked after "
                  f"{before >> 20} MiB of {n >> 20} MiB")
            go.set()
            sender.join(60)
            assert not sender.is_alive()
        wait_for(lambda: digest, 60, "the sink read the whole stream")
        h = hashlib.sha256()
        for _ in range(n // len(block)):
            h.update(block)
        assert digest[0] == h.digest()
        assert link.held_peak == cap and link.up == n
    finally:
        go.set()
        link.close()
        srv.close()


def test_cut_and_heal_still_work_on_a_delayed_link(echo: _Server) -> None:
    link = WanLink(echo.port, delay_s=0.02)
    try:
        with socket.create_connection(("127.0.0.1", link.port), timeout=10) as s:
            s.sendall(b"a")
            assert _recv_exactly(s, 1) == b"a"
            link.cut()
            s.sendall(b"b")
            s.settimeout(0.3)
            with pytest.raises(TimeoutError):
                s.recv(1)  # silence: nothing moves, nothing closes
            link.heal()
            s.settimeout(10)
            with pytest.raises(ConnectionResetError):
                s.recv(1)  # the connection that lived through the cut is gone
        assert _round_trips(link.port, 1)[0] >= 0.04  # new ones are relayed, delayed, again
        assert link.connections == 2
    finally:
        link.close()


@pytest.mark.parametrize("kw", [{"delay_s": -0.1}, {"delay_s": math.nan}, {"delay_s": math.inf},
                                {"loss": -0.01}, {"loss": 1.0}, {"loss": math.nan},
                                {"max_held": 0}, {"delay_s": "1"}])
def test_bad_values_are_one_clear_line(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError) as err:
        WanLink(1, **kw)  # type: ignore[arg-type]  # wrong types are the point
    msg = str(err.value)
    assert msg.startswith("WanLink: ") and "\n" not in msg and next(iter(kw)) in msg, msg
