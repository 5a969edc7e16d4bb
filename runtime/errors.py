"""One error hierarchy for every Fogline process.

Expected outcomes (a workload does not fit) are values, not exceptions. These
classes are for violations: ``LocalViolation`` when our own code misuses an
API, ``RemoteViolation`` when a peer sent something wrong. The shell of every
process logs, counts and drops remote violations; it never dies of one.
"""
from __future__ import annotations

__all__ = ["FoglineError", "LocalViolation", "RemoteViolation", "DecodeError", "SecurityError"]


class FoglineError(Exception):
    """Base of every error Fogline raises on purpose."""


class LocalViolation(FoglineError):
    """Our side broke a contract (a bug or a misuse of an API)."""


class RemoteViolation(FoglineError, ValueError):
    """A peer (device, broker, client, file) sent something we must reject."""


class DecodeError(RemoteViolation):
    """Bytes that are not a valid message: malformed, oversized, mistyped or unknown."""


class SecurityError(RemoteViolation):
    """A signature, identity or freshness check failed; ``reason`` is a fixed phrase."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
