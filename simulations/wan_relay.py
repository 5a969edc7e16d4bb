"""A TCP relay that can be cut like a WAN and healed: the fault the many-sites tests and benchmarks inject.

It stands between the coordinator and one site's broker (or a site and the
coordinator's SuperLink) and counts the bytes it relays. Unlike stopping a
process or closing a socket, a cut here sends nothing at all (no FIN, no RST),
which is what a dropped link looks like to both ends: they learn of it only
from their own keepalives and timeouts.
"""
from __future__ import annotations

import select
import socket
import threading
import time

__all__ = ["WanLink"]


class WanLink:
    """A TCP relay 127.0.0.1:port -> target that can be cut like a WAN and healed.

    Cut: nothing is read, forwarded or closed on any connection, and new connections are held
    unanswered (the TCP handshake completes locally, the TLS one never does): both ends see
    silence, as when packets are dropped. Heal: every connection that lived through the cut is
    reset (its TCP state is gone, as after a NAT timeout); new ones are relayed again.
    """

    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._live: list[socket.socket] = []      # every open socket (both sides of each relayed connection)
        self.connections = 0                      # relayed connections made (the coordinator's reconnects)
        self.up = 0                               # bytes relayed client -> target (what crossed the WAN)
        self.down = 0                             # bytes relayed target -> client
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
                self.connections += 1
            threading.Thread(target=self._relay, args=(client, upstream), name="wan-relay", daemon=True).start()

    def _relay(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while not self._closed.is_set():
                if self._cut.is_set():
                    time.sleep(0.05)  # dropped on the floor: nothing moves, nothing closes
                    continue
                r, _, _ = select.select([a, b], [], [], 0.2)
                if self._cut.is_set():
                    continue
                for s in r:
                    data = s.recv(65536)
                    if not data:
                        raise ConnectionError("closed")
                    (b if s is a else a).sendall(data)
                    with self._lock:
                        if s is a:
                            self.up += len(data)
                        else:
                            self.down += len(data)
        except (OSError, ValueError, ConnectionError):
            pass
        for s in (a, b):
            _reset(s)


def _reset(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST on close
    except OSError:
        pass
    try:
        s.close()
    except OSError:
        pass
