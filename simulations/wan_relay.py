"""A TCP relay that can be cut like a WAN and healed, and that can delay and lose like one.

It stands between the coordinator and one site's broker (or a site and the
coordinator's SuperLink, or a device and its fog's mosquitto) and counts the
bytes it relays. Unlike stopping a process or closing a socket, a cut here
sends nothing at all (no FIN, no RST), which is what a dropped link looks like
to both ends: they learn of it only from their own keepalives and timeouts.

Delay and loss are emulated at the relay, as the TCP endpoints would see them,
because this repo's CI kernel has no ``sch_netem`` (``simulations.netshape``
shapes bandwidth with ``tbf`` but refuses delay and loss): a byte read at ``t``
is written at ``t + delay_s`` in each direction, and a "lost" segment is what
TCP makes of a loss, a retransmission stall: it and everything behind it on that
connection arrive one retransmission timeout later. No packet is really dropped
and no real retransmission happens, so congestion control never reacts (a
window that halves after a loss is not modelled); what is real is the time the
bytes take, which is what the tests and benchmarks measure.
"""
from __future__ import annotations

import collections
import math
import random
import select
import socket
import threading
import time
from collections.abc import Callable

__all__ = ["MSS", "WanLink", "plan_segments"]

MSS = 1448            # payload bytes of one TCP segment on a 1500-byte MTU path (with timestamps)
_RTO_FLOOR_S = 0.2    # Linux's TCP_RTO_MIN: no retransmission timeout is shorter
_CHUNK = 65536        # bytes read at most per recv


def plan_segments(now: float, pos: int, n: int, *, last_due: float, delay_s: float, loss: float,
                  rto_s: float, draw: Callable[[], float]) -> list[tuple[int, float]]:
    """When the bytes ``[pos, pos + n)`` of one direction, read at ``now``, are due at the far end.

    Pure core of the relay's timing: ``(length, due)`` pieces in order. Each piece is due at
    ``now + delay_s`` but never before what went before it (order is kept); each segment (of
    ``MSS`` bytes, counted from the stream's start) that begins here is lost with probability
    ``loss`` (one ``draw()`` each, only when ``loss > 0``), and a lost one and everything behind
    it is held back a further ``rto_s`` (a retransmission stall)."""
    due = max(now + delay_s, last_due)
    if loss <= 0.0:
        return [(n, due)]
    pieces: list[tuple[int, float]] = []
    start, end = pos, pos + n
    seg = -(-pos // MSS) * MSS  # the first segment boundary at or after pos
    while seg < end:
        if draw() < loss:
            if seg > start:
                pieces.append((seg - start, due))
            start, due = seg, due + rto_s
        seg += MSS
    pieces.append((end - start, due))
    return pieces


class _Flow:
    """One direction of one relayed connection: bytes read from ``src`` wait here until due at ``dst``."""

    __slots__ = ("blocked", "done", "dst", "eof", "held", "last_due", "pos", "queue", "rng", "src",
                 "up")

    def __init__(self, src: socket.socket, dst: socket.socket, up: bool, rng: random.Random) -> None:
        self.src, self.dst, self.up, self.rng = src, dst, up, rng
        self.queue: collections.deque[tuple[float, memoryview | None]] = collections.deque()  # None: FIN
        self.held = 0          # bytes read from src not yet written to dst
        self.pos = 0           # bytes read from src so far (the stream offset of the next byte)
        self.last_due = 0.0
        self.eof = False       # src sent FIN (it is queued behind the bytes before it)
        self.done = False      # ... and it was passed on to dst
        self.blocked = False   # dst's send buffer is full with a due piece waiting


class WanLink:
    """A TCP relay 127.0.0.1:port -> target that can be cut like a WAN and healed.

    Cut: nothing is read, forwarded or closed on any connection, and new connections are held
    unanswered (the TCP handshake completes locally, the TLS one never does): both ends see
    silence, as when packets are dropped. Heal: every connection that lived through the cut is
    reset (its TCP state is gone, as after a NAT timeout); new ones are relayed again.

    ``delay_s`` (one way, each direction) and ``loss`` (per ``MSS`` segment, seen as a stall of
    one retransmission timeout, ``max(0.2 s, 2 * RTT)``) shape every connection; ``seed`` makes
    the losses reproduce (each connection and direction draws from its own stream). At most
    ``max_held`` bytes wait in each direction of a connection: past that the relay stops reading
    from the sender (backpressure through TCP's own windows), never an unbounded buffer; like a
    TCP window it bounds each direction's rate at ``max_held / delay_s`` bytes/s.
    """

    def __init__(self, target_port: int, *, delay_s: float = 0.0, loss: float = 0.0, seed: int = 0,
                 max_held: int = 1 << 20) -> None:
        _check(delay_s, loss, seed, max_held)
        self.target = ("127.0.0.1", target_port)
        self.delay_s = float(delay_s)
        self.loss = float(loss)
        self.seed = seed
        self.max_held = max_held
        self.rto_s = max(_RTO_FLOOR_S, 2 * (2 * self.delay_s))  # 2 x the round trip the link adds
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._live: list[socket.socket] = []      # every open socket (both sides of each relayed connection)
        self.connections = 0                      # relayed connections made (the coordinator's reconnects)
        self.up = 0                               # bytes relayed client -> target (what crossed the WAN)
        self.down = 0                             # bytes relayed target -> client
        self.delayed = 0                          # bytes held back before delivery (delay or a stall)
        self.lost = 0                             # segments "lost" (each a retransmission stall)
        self.stall_s = 0.0                        # seconds of stall added by those losses
        self.held = 0                             # bytes waiting in the relay now (all connections)
        self.held_peak = 0                        # most bytes ever waiting in one direction of one connection
        threading.Thread(target=self._accept, name="wan-accept", daemon=True).start()

    def cut(self) -> None:
        self._cut.set()

    def heal(self) -> None:
        with self._lock:
            doomed, self._live = self._live, []
        for s in doomed:
            _reset(s)
        self._cut.clear()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        self.heal()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._live.append(client)
            if self._cut.is_set():
                continue  # held: never answered, reset at heal
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._live.append(upstream)
                k = self.connections
                self.connections += 1
            threading.Thread(target=self._relay, args=(client, upstream, k), name="wan-relay",
                             daemon=True).start()

    def _relay(self, a: socket.socket, b: socket.socket, k: int) -> None:
        flows = [_Flow(a, b, True, random.Random(f"{self.seed}/{k}/up")),
                 _Flow(b, a, False, random.Random(f"{self.seed}/{k}/down"))]
        clean = False
        try:
            a.setblocking(False)
            b.setblocking(False)
            while not self._closed.is_set():
                if self._cut.is_set():
                    time.sleep(0.05)  # dropped on the floor: nothing moves, nothing closes
                    continue
                now = time.monotonic()
                for f in flows:
                    self._flush(f, now)
                if all(f.done for f in flows):
                    clean = True
                    break
                wait = 0.2
                for f in flows:
                    if f.queue and not f.blocked:
                        wait = min(wait, f.queue[0][0] - now)
                r, _, _ = select.select([f.src for f in flows if not f.eof and f.held < self.max_held],
                                        [f.dst for f in flows if f.blocked], [], max(0.0, wait))
                if self._cut.is_set():
                    continue
                now = time.monotonic()
                for f in flows:
                    if f.src in r:
                        self._read(f, now)
        except (OSError, ValueError, ConnectionError):
            pass
        with self._lock:
            self.held -= sum(f.held for f in flows)
            self._live = [s for s in self._live if s is not a and s is not b]
        for s in (a, b):
            if clean:
                s.close()
            else:
                _reset(s)

    def _read(self, f: _Flow, now: float) -> None:
        try:
            data = f.src.recv(min(_CHUNK, self.max_held - f.held))
        except BlockingIOError:
            return
        if not data:  # FIN: passed on behind the bytes before it
            f.eof = True
            f.queue.append((max(now + self.delay_s, f.last_due), None))
            return
        pieces = plan_segments(now, f.pos, len(data), last_due=f.last_due, delay_s=self.delay_s,
                               loss=self.loss, rto_s=self.rto_s, draw=f.rng.random)
        view, off, late = memoryview(data), 0, 0
        for length, due in pieces:
            f.queue.append((due, view[off:off + length]))
            off += length
            if due > now:
                late += length
        f.pos += len(data)
        f.held += len(data)
        f.last_due = pieces[-1][1]
        with self._lock:
            self.held += len(data)
            self.held_peak = max(self.held_peak, f.held)
            self.delayed += late
            self.lost += len(pieces) - 1
            self.stall_s += (len(pieces) - 1) * self.rto_s

    def _flush(self, f: _Flow, now: float) -> None:
        """Write what is due to ``dst`` without blocking; what does not fit waits for writability."""
        f.blocked = False
        sent = 0
        while f.queue and f.queue[0][0] <= now:
            due, piece = f.queue[0]
            if piece is None:
                f.queue.popleft()
                f.dst.shutdown(socket.SHUT_WR)
                f.done = True
                break
            try:
                n = f.dst.send(piece)
            except BlockingIOError:
                f.blocked = True
                break
            sent += n
            if n < len(piece):
                f.queue[0] = (due, piece[n:])
                f.blocked = True
                break
            f.queue.popleft()
        if sent:
            f.held -= sent
            with self._lock:
                self.held -= sent
                if f.up:
                    self.up += sent
                else:
                    self.down += sent


def _check(delay_s: float, loss: float, seed: int, max_held: int) -> None:
    """One clear line for a link that cannot exist."""
    if not isinstance(delay_s, (int, float)) or not math.isfinite(delay_s) or delay_s < 0:
        raise ValueError(f"WanLink: delay_s must be a finite number of seconds >= 0, got {delay_s!r}")
    if not isinstance(loss, (int, float)) or not 0.0 <= loss < 1.0:  # nan fails both comparisons
        raise ValueError(f"WanLink: loss must be a probability in [0, 1), got {loss!r}")
    if not isinstance(seed, int):
        raise ValueError(f"WanLink: seed must be an int, got {seed!r}")
    if not isinstance(max_held, int) or max_held <= 0:
        raise ValueError(f"WanLink: max_held must be a positive number of bytes, got {max_held!r}")


def _reset(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
