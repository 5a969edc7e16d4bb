"""Small facts about addresses that several commands need (one place for each)."""
from __future__ import annotations

import ipaddress
import logging
import socket

from .errors import LocalViolation

__all__ = ["is_loopback", "require_loopback", "INSECURE_WARNING"]

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
