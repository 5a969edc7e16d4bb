"""Find fog brokers with mDNS/DNS-SD (zeroconf): ``_fogline._tcp.local.``.

Discovery only tells a device where its site's MQTT broker is; it is never a
liveness signal (that is the MQTT Will and the state deadline). Measured
here: binding to ``127.0.0.1`` or ``InterfaceChoice.All`` works in a
container without a multicast route, ``InterfaceChoice.Default`` fails; and
only an orderly unregister sends the goodbye packets, so ``close()`` does it.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from zeroconf import IPVersion, ServiceBrowser, ServiceInfo, ServiceListener, Zeroconf

from .messages import PROTOCOL_VERSION

__all__ = ["SERVICE_TYPE", "FogService", "Advertisement", "advertise", "browse"]

log = logging.getLogger(__name__)

SERVICE_TYPE = "_fogline._tcp.local."
DEFAULT_INTERFACES = ["127.0.0.1"]


@dataclass(frozen=True, slots=True)
class FogService:
    site: str
    fog_id: str
    host: str
    port: int
    protocol: int


def _info(site: str, fog_id: str, host: str, port: int) -> ServiceInfo:
    return ServiceInfo(
        SERVICE_TYPE,
        f"{fog_id}.{SERVICE_TYPE}",
        addresses=[socket.inet_aton(host)],
        port=port,
        properties={"site": site, "fog": fog_id, "proto": str(PROTOCOL_VERSION),
                    "host": host, "port": str(port)},
        server=f"{fog_id}.local.",
    )


class Advertisement:
    """A registered service; ``close()`` unregisters (goodbye packets) and stops zeroconf."""

    def __init__(self, zc: Zeroconf, info: ServiceInfo) -> None:
        self._zc = zc
        self._info = info
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._zc.unregister_service(self._info)
        finally:
            self._zc.close()


def advertise(site: str, fog_id: str, host: str, port: int,
              interfaces: list[str] | None = None) -> Advertisement:
    zc = Zeroconf(interfaces=interfaces or DEFAULT_INTERFACES, ip_version=IPVersion.V4Only)
    info = _info(site, fog_id, host, port)
    zc.register_service(info, allow_name_change=True)
    return Advertisement(zc, info)


class _Collector(ServiceListener):
    def __init__(self) -> None:
        self.names: set[str] = set()
        self.event = threading.Event()

    def add_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.names.add(name)
        self.event.set()

    def update_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.names.add(name)

    def remove_service(self, zc: Zeroconf, type_: str, name: str) -> None:
        self.names.discard(name)


def _decode(info: ServiceInfo) -> FogService | None:
    props = {k.decode(): (v.decode() if v else "") for k, v in info.properties.items()}
    try:
        host = props.get("host") or socket.inet_ntoa(info.addresses[0])
        return FogService(props.get("site", ""), props.get("fog", ""), host,
                          int(props.get("port") or info.port or 0), int(props.get("proto", "0")))
    except (ValueError, IndexError, OSError):
        log.debug("ignoring malformed service record %s", info.name)
        return None


def browse(timeout: float = 3.0, site: str | None = None,
           interfaces: list[str] | None = None) -> list[FogService]:
    """Services seen within ``timeout`` (returns early once one matching ``site`` resolves)."""
    zc = Zeroconf(interfaces=interfaces or DEFAULT_INTERFACES, ip_version=IPVersion.V4Only)
    collector = _Collector()
    browser = ServiceBrowser(zc, SERVICE_TYPE, collector)
    found: dict[str, FogService] = {}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            collector.event.wait(min(0.2, max(0.0, deadline - time.monotonic())))
            collector.event.clear()
            for name in list(collector.names - found.keys()):
                info = zc.get_service_info(SERVICE_TYPE, name, timeout=500)
                svc = _decode(info) if info else None
                if svc is not None and svc.protocol == PROTOCOL_VERSION:
                    found[name] = svc
            if site is not None and any(s.site == site for s in found.values()):
                break
    finally:
        browser.cancel()
        zc.close()
    return [s for s in found.values() if site is None or s.site == site]
