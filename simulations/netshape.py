"""Links that behave like links: network namespaces joined to this one by shaped veth pairs.

A test or benchmark that wants a device behind a slow link puts the device's process in a
namespace of its own (``ip netns exec``, ``NetShape.wrap``), joined to the host namespace by a
veth pair, and lets the kernel shape it: ``tbf`` (token bucket) on each end's egress sets the
device's uplink and downlink, so transfer time is what the bytes take on the wire, not what a
model assumes. Delay and loss need ``sch_netem``; where the kernel has no netem (this repo's CI
container: no module, no modprobe) ``probe`` says so and ``add`` refuses them in one line
rather than pretending.

Needs root (CAP_NET_ADMIN), ``ip`` and ``tc``; ``probe()`` returns the reason when they are not
there, for ``pytest.skip``. Every namespace made here is deleted by ``close()`` (its veth pair
with it); the processes in it must be stopped first.
"""
from __future__ import annotations

import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

__all__ = ["Link", "NetShape", "ShapeError"]


class ShapeError(RuntimeError):
    """A namespace, veth pair or qdisc could not be set up; the message says which command."""


def _run(*argv: str) -> None:
    r = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=20,
                       stdin=subprocess.DEVNULL)
    if r.returncode != 0:
        raise ShapeError(f"{' '.join(argv)}: {(r.stderr or r.stdout).strip()}")


@dataclass(frozen=True, slots=True)
class Link:
    """One shaped link: namespace ``ns`` reaches the host namespace at ``host_ip``."""

    ns: str
    host_ip: str
    ns_ip: str
    uplink_bps: float     # ns -> host (the device sends)
    downlink_bps: float   # host -> ns (the device receives)
    host_dev: str = ""
    ns_dev: str = ""

    @property
    def wrap(self) -> list[str]:
        """The argv prefix running a command inside this link's namespace."""
        return ["ip", "netns", "exec", self.ns]


class NetShape:
    """Namespaces with shaped links to the host namespace; a context manager that deletes them."""

    def __init__(self) -> None:
        self._tag = secrets.token_hex(3)
        self._net = 16 + secrets.randbelow(200)  # 10.<net>.k.0/30: unlikely to meet another run's
        self.links: list[Link] = []

    @staticmethod
    def probe() -> str | None:
        """Why shaped namespaces cannot work here, or None when they can."""
        if os.geteuid() != 0:
            return "needs root (CAP_NET_ADMIN) for network namespaces"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
                return f"'{tool}' (iproute2) is not installed"
        return None

    @staticmethod
    def has_netem() -> bool:
        """Whether the kernel offers ``sch_netem`` (delay, loss): tried on a throwaway namespace."""
        ns = f"flnp{secrets.token_hex(3)}"
        try:
            _run("ip", "netns", "add", ns)
            _run("tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms")
            return True
        except ShapeError:
            return False
        finally:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)

    def add(self, uplink_bps: float, downlink_bps: float | None = None, *, delay_s: float = 0.0,
            loss: float = 0.0) -> Link:
        """A new namespace whose link sends at ``uplink_bps`` and receives at ``downlink_bps``
        (default: the same); ``delay_s`` one way on each side and ``loss`` (0..1) need netem."""
        down = uplink_bps if downlink_bps is None else downlink_bps
        if not (uplink_bps > 0 and down > 0 and delay_s >= 0 and 0 <= loss < 1):
            raise ShapeError(f"bad link: up {uplink_bps}, down {down}, delay {delay_s}, loss {loss}")
        k = len(self.links)
        ns, hdev, ndev = f"fl{self._tag}{k}", f"flh{self._tag}{k}", f"fln{self._tag}{k}"
        host_ip, ns_ip = f"10.{self._net}.{k}.1", f"10.{self._net}.{k}.2"
        _run("ip", "netns", "add", ns)
        link = Link(ns, host_ip, ns_ip, float(uplink_bps), float(down), hdev, ndev)
        self.links.append(link)
        _run("ip", "link", "add", hdev, "type", "veth", "peer", "name", ndev)
        _run("ip", "link", "set", ndev, "netns", ns)
        _run("ip", "addr", "add", f"{host_ip}/30", "dev", hdev)
        _run("ip", "link", "set", hdev, "up")
        _run("ip", "-n", ns, "addr", "add", f"{ns_ip}/30", "dev", ndev)
        _run("ip", "-n", ns, "link", "set", ndev, "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        self._shape([], hdev, down, delay_s, loss)           # host -> ns: the device's downlink
        self._shape(["-n", ns], ndev, uplink_bps, delay_s, loss)  # ns -> host: its uplink
        return link

    def set_rates(self, link: Link, uplink_bps: float, downlink_bps: float | None = None) -> Link:
        """Change a link's rates in place (``tc qdisc replace``): connections stay up, as when a
        radio link degrades. The link as it is now."""
        down = uplink_bps if downlink_bps is None else downlink_bps
        if not (uplink_bps > 0 and down > 0):
            raise ShapeError(f"bad link: up {uplink_bps}, down {down}")
        self._shape([], link.host_dev, down, 0.0, 0.0, "replace")
        self._shape(["-n", link.ns], link.ns_dev, uplink_bps, 0.0, 0.0, "replace")
        new = Link(link.ns, link.host_ip, link.ns_ip, float(uplink_bps), float(down),
                   link.host_dev, link.ns_dev)
        self.links = [new if x.ns == link.ns else x for x in self.links]
        return new

    @staticmethod
    def _shape(where: list[str], dev: str, bps: float, delay_s: float, loss: float,
               verb: str = "add") -> None:
        rate = f"{int(bps)}bit"
        if delay_s or loss:  # netem shapes rate too; refused in one line where the kernel lacks it
            try:
                _run("tc", *where, "qdisc", verb, "dev", dev, "root", "netem", "rate", rate,
                     "delay", f"{delay_s * 1e3:g}ms", "loss", f"{loss * 100:g}%", "limit", "10000")
            except ShapeError as exc:
                raise ShapeError(f"delay/loss need sch_netem, which this kernel lacks ({exc})"
                                 ) from None
            return
        # burst: 10 ms at the rate (at least a few full frames); a queue of ~200 ms before drops
        burst = max(16_000, int(bps / 8 / 100))
        _run("tc", *where, "qdisc", verb, "dev", dev, "root", "tbf", "rate", rate,
             "burst", str(burst), "latency", "200ms")

    def close(self) -> None:
        """Delete every namespace made here (their veth pairs go with them)."""
        for link in self.links:
            subprocess.run(["ip", "netns", "del", link.ns], capture_output=True, check=False)
        self.links.clear()

    def __enter__(self) -> NetShape:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
