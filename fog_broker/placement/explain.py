"""Why a workload is pending, as data first and sentences second.

Per-node reasons are fixed phrases counted into a histogram, Kubernetes ``FitError``
style: ``0/7 devices fit: 4 insufficient memory, 3 selector mismatch``. Byte counts
and ids live in structured detail, and the sentences are built from it.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

__all__ = ["histogram", "fit_summary", "human_bytes", "memory_sentence", "quota_sentence"]


def histogram(phrases: Iterable[str]) -> tuple[tuple[str, int], ...]:
    """Count identical phrases; most frequent first, then alphabetical (stable output)."""
    c = Counter(phrases)
    return tuple(sorted(c.items(), key=lambda kv: (-kv[1], kv[0])))


def fit_summary(total: int, fit: int, hist: Iterable[tuple[str, int]]) -> str:
    parts = ", ".join(f"{n} {phrase}" for phrase, n in hist)
    return f"{fit}/{total} devices fit" + (f": {parts}" if parts else "")


def human_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def memory_sentence(need: float, largest: float, total_free: float, fit_devices: int) -> str:
    """Tell fragmentation (enough free in total) apart from plain shortage."""
    if fit_devices == 0:
        return f"no device can hold any partition (needs at least {human_bytes(need)} in total)"
    if total_free >= need:
        return (f"no chain fits: needs {human_bytes(need)}, {human_bytes(total_free)} free in total "
                f"but largest free {human_bytes(largest)} (fragmented)")
    return (f"no chain fits: needs {human_bytes(need)}, only {human_bytes(total_free)} free "
            f"on eligible devices")


def quota_sentence(tenant: str, asked: float, left: float) -> str:
    return (f"quota exhausted: tenant {tenant}: {human_bytes(asked)} asked, "
            f"{human_bytes(max(left, 0.0))} left")
