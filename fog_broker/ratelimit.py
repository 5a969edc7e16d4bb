"""The fog's rate limits: ``runtime.ratelimit`` (shared with the agent) and the ACL of a quarantine.

A quarantined sender (``FairShare``, keyed by the id its topics carry) loses its write rights
at the broker (``acl_shut_out``), so the rest of its flood never reaches the fog.
"""
from __future__ import annotations

from collections.abc import Set

from runtime.ratelimit import (
    BULK,
    LIVE,
    OVER,
    QUARANTINED,
    Budget,
    Copies,
    FairShare,
    LogLimit,
    RateLimit,
    SharePolicy,
)

__all__ = ["BULK", "LIVE", "OVER", "QUARANTINED", "Budget", "Copies", "FairShare", "LogLimit", "RateLimit",
           "SharePolicy", "acl_shut_out"]


def acl_shut_out(acl: str, names: Set[str]) -> str:
    """``acl`` (``runtime.broker.acl_for``) with the write rights of ``names`` withheld, reads kept.

    A quarantined sender's flood then stops at the broker: it never reaches the fog's one MQTT
    connection, where it would queue ahead of everyone else's messages.
    """
    if not names:
        return acl
    out: list[str] = []
    user = ""
    for line in acl.split("\n"):
        if line.startswith("user "):
            user = line[len("user "):]
            out.append(line)
            if user in names:
                out.append("# quarantined for flooding: writes withheld (fogline status)")
            continue
        if user in names and line.startswith("topic write "):
            continue
        if user in names and line.startswith("topic readwrite "):
            line = "topic read " + line[len("topic readwrite "):]
        out.append(line)
    return "\n".join(out)
