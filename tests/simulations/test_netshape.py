"""simulations.netshape: a process in a shaped namespace moves bytes at the link's rate, both ways,
measured on real TCP across the veth pair (not a model of it)."""
from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest

from simulations.netshape import Link, NetShape, ShapeError

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

_why = NetShape.probe()
if _why is not None:  # pragma: no cover - CI runs as root with iproute2
    pytest.skip(f"shaped links unavailable: {_why}", allow_module_level=True)

_CLIENT = """
import socket, sys, time
host, port, up, down = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
s = socket.create_connection((host, port), timeout=20)
s.sendall(b"u" * up)
s.shutdown(socket.SHUT_WR)
b = s.recv(65536)
t0, got = time.perf_counter(), len(b)  # from the first byte, as the server times the upload
while b and got < down:
    b = s.recv(65536)
    got += len(b)
print(got, time.perf_counter() - t0)
"""


def _rates(link: Link, up_n: int, down_n: int) -> tuple[float, float]:
    """(uplink, downlink) bit/s a process inside ``link``'s namespace gets over TCP."""
    srv = socket.create_server((link.host_ip, 0))
    port = srv.getsockname()[1]
    seen: dict[str, float] = {}

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            t0, got, first = 0.0, 0, True
            while True:
                b = conn.recv(65536)
                if not b:
                    break
                if first:  # time from the first byte: the handshake is not the link's rate
                    t0, first = time.perf_counter(), False
                got += len(b)
            seen["up_s"], seen["up_bytes"] = time.perf_counter() - t0, got
            conn.sendall(b"d" * down_n)

    th = threading.Thread(target=serve, daemon=True)
    th.start()
    try:
        r = subprocess.run([*link.wrap, sys.executable, "-c", _CLIENT, link.host_ip, str(port),
                            str(up_n), str(down_n)], capture_output=True, text=True, timeout=40,
                           check=True)
        th.join(10)
    finally:
        srv.close()
    got, down_s = r.stdout.split()
    assert seen["up_bytes"] == up_n and int(got) == down_n
    return 8 * up_n / seen["up_s"], 8 * down_n / float(down_s)


def _near(rate: float, bps: float) -> bool:
    """What TCP gets out of a token bucket: a little under the rate, never much over it."""
    return 0.7 * bps < rate < 1.15 * bps


def test_uplink_and_downlink_run_at_their_shaped_rates() -> None:
    with NetShape() as shape:
        link = shape.add(8e6, 32e6)
        up, down = _rates(link, 1_000_000, 2_000_000)
        assert _near(up, 8e6) and _near(down, 32e6), (up, down)
        # a link that degrades under a live namespace: the new rates hold at once
        link = shape.set_rates(link, 32e6, 4e6)
        up, down = _rates(link, 2_000_000, 500_000)
        assert _near(up, 32e6) and _near(down, 4e6), (up, down)
    assert not shape.links


def test_delay_and_loss_need_netem_and_say_so() -> None:
    with NetShape() as shape:
        if NetShape.has_netem():
            link = shape.add(1e8, delay_s=0.05)
            assert link.ns
        else:  # this container's kernel: no sch_netem; refused in one line, no half-made link
            with pytest.raises(ShapeError, match="sch_netem"):
                shape.add(1e8, delay_s=0.05)
        with pytest.raises(ShapeError, match="bad link"):
            shape.add(0)
