"""One error hierarchy for every Fogline process.

Expected outcomes (a workload does not fit) are values, not exceptions. These
classes are for violations: ``LocalViolation`` when our own code misuses an
API, ``RemoteViolation`` when a peer sent something wrong. The shell of every
process logs, counts and drops remote violations; it never dies of one.
"""
from __future__ import annotations

__all__ = ["FoglineError", "LocalViolation", "RemoteViolation", "OutOfRange", "DecodeError", "SecurityError"]


class FoglineError(Exception):
    """Base of every error Fogline raises on purpose."""


class LocalViolation(FoglineError):
    """Our side broke a contract (a bug or a misuse of an API)."""


class RemoteViolation(FoglineError, ValueError):
    """A peer (device, broker, client, file) sent something we must reject."""


class OutOfRange(RemoteViolation):
    """A number outside its documented range (``runtime.devices``): ``owner`` (the record's kind),
    ``field`` and ``value`` say which, as attributes a reader uses as they are (never the text)."""

    def __init__(self, owner: str, field: str, value: float | int, why: str) -> None:
        super().__init__(f"out of range: {owner}.{field}={value!r} ({why})")
        self.owner, self.field, self.value, self.why = owner, field, value, why

    def __reduce__(self) -> tuple[type[OutOfRange], tuple[str, str, float | int, str]]:
        return OutOfRange, (self.owner, self.field, self.value, self.why)  # crosses the verify pipe


class DecodeError(RemoteViolation):
    """Bytes that are not a valid message: malformed, oversized, mistyped or unknown.

    ``out_of_range``: the figure that made a well-formed message invalid, when that was why.
    """

    def __init__(self, message: str, *, out_of_range: OutOfRange | None = None) -> None:
        super().__init__(message)
        self.out_of_range = out_of_range


class SecurityError(RemoteViolation):
    """A signature, identity or freshness check failed; ``reason`` is a fixed phrase."""

    def __init__(self, reason: str, detail: str = "", *, out_of_range: OutOfRange | None = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        #: a signed payload refused for one figure outside its range (``DecodeError.out_of_range``)
        self.out_of_range = out_of_range
