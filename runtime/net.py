"""Small facts about addresses that several commands need (one place for each)."""
from __future__ import annotations

import ipaddress
import logging
import socket

from .errors import LocalViolation

__all__ = ["is_loopback", "require_loopback", "INSECURE_WARNING", "parse_hostport", "split_hostport"]

log = logging.getLogger("fogline.security")

INSECURE_WARNING = ("INSECURE: plain MQTT without TLS to %s; anyone who can reach that port can read and "
                    "write this site's traffic (tests and demos on one machine only)")


def is_loopback(host: str) -> bool:
    """True when every address ``host`` resolves to is a loopback address."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addrs = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addrs) and all(ipaddress.ip_address(str(a).split("%")[0]).is_loopback for a in addrs)


def require_loopback(host: str, flag: str = "--insecure", what: str = "plain MQTT") -> None:
    """Refuse ``flag`` for a non-loopback ``host``; on loopback, warn loudly and go on."""
    if not is_loopback(host):
        raise LocalViolation(f"{flag} is refused for {host}: {what} only on a loopback address; use TLS "
                             "credentials (docs/security.md) for anything else")
    log.warning(INSECURE_WARNING.replace("plain MQTT", what), host)


def split_hostport(text: str) -> tuple[str, int | None]:
    """``HOST:PORT``, ``[V6]:PORT``, ``HOST``, ``[V6]`` or a bare IPv6 address -> (host, port or None).

    Raises ValueError naming ``text`` when the port is not a number in 0-65535 or the host is empty.
    """
    s = text.strip()
    if s.startswith("["):
        host, sep, rest = s[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(f"expected HOST:PORT, got {text!r}")
        port_text = rest[1:] if rest else None
    elif s.count(":") > 1:  # a bare IPv6 address: no port
        host, port_text = s, None
    else:
        host, sep, port_text = s.partition(":")
        port_text = port_text if sep else None
    if not host:
        raise ValueError(f"expected HOST:PORT, got {text!r} (no host)")
    if any(c.isspace() or c in "/@?#" for c in host):
        raise ValueError(f"expected HOST:PORT, got {text!r} (not a host name)")
    if port_text is None:
        return host, None
    if not port_text.isdigit():
        raise ValueError(f"expected HOST:PORT, got {text!r} (port {port_text!r} is not a number)")
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"expected HOST:PORT, got {text!r} (port {port} is above 65535)")
    return host, port


def parse_hostport(text: str, default_port: int = 1883) -> tuple[str, int]:
    """``HOST[:PORT]`` -> (host, port); a missing port is ``default_port`` (8883 for MQTT over TLS)."""
    host, port = split_hostport(text)
    return host, default_port if port is None else port
