"""Registering the authorized SuperNode keys with the SuperLink: idempotent, bounded, and never a traceback.

``flwr supernode register`` is a whole CLI process per key (seconds each on a
busy host) and Flower's ``flwr supernode list`` does not show keys. So the
coordinator keeps a ledger next to the SuperLink's database
(``superlink-nodes.json``: key id -> the node id Flower returned) and
registers only the keys whose node id Flower does not list any more (new
keys, a new database). Registrations run a few at a time, each try bounded,
transient failures retried with backoff; a key that cannot be registered
stops the coordinator with one line naming the device and Flower's reason,
rather than letting it wait for SuperNodes that will never be let in.

The decisions (``plan``, ``parse_*``, ``classify``) are pure; ``register_all``
takes the command runner as a parameter so they are tested without Flower.
"""
from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from runtime.errors import FoglineError
from runtime.files import atomic_write

__all__ = ["LEDGER_FILE", "Budget", "Outcome", "RegistrationFailed", "classify", "load_ledger", "parse_listed",
           "plan", "register_all", "save_ledger"]

log = logging.getLogger(__name__)
LEDGER_FILE = "superlink-nodes.json"
_GONE = frozenset({"unregistered", "deleted"})
_USING = re.compile(r"^Using SuperLink: \S+ \([^)]*\)")  # flwr's preamble before the error itself


class RegistrationFailed(FoglineError):
    """A key could not be registered: SuperNodes with it would be refused for ever."""


@dataclass(frozen=True, slots=True)
class Budget:
    """How long and how often: per try, tries per key, backoff, keys at a time."""

    try_s: float = 45.0        # one ``flwr supernode register`` (a Python CLI start + one Control call)
    attempts: int = 3
    backoff_s: float = 1.0     # doubled after each failed try
    workers: int = 4

    def total_s(self, keys: int) -> float:
        """The most registering ``keys`` can take: waves of ``workers``, each key its tries and backoffs."""
        waves = -(-keys // max(1, self.workers))
        per_key = self.attempts * self.try_s + self.backoff_s * (2 ** max(0, self.attempts - 1) - 1)
        return float(waves * per_key)


@dataclass(frozen=True, slots=True)
class Outcome:
    """One command's result as the registration logic sees it."""

    ok: bool
    node_id: str = ""          # Flower's node id for the key ("" when it was already registered)
    transient: bool = False    # worth another try (timeout, SuperLink not answering)
    reason: str = ""


def plan(book: Mapping[str, str], ledger: Mapping[str, str], listed: Mapping[str, str] | None) -> list[str]:
    """Devices whose keys to register, sorted.

    ``book``: device -> key id; ``ledger``: key id -> node id we registered;
    ``listed``: node id -> status from Flower (None: could not ask, so register all).
    """
    if listed is None:
        return sorted(book)
    out = []
    for dev, kid in book.items():
        node = ledger.get(kid, "")
        if not node or listed.get(node, "unregistered") in _GONE:
            out.append(dev)
    return sorted(out)


def parse_listed(stdout: str) -> dict[str, str] | None:
    """``flwr supernode list --format json`` -> node id -> status (None when it did not succeed)."""
    try:
        doc = json.loads(stdout[stdout.index("{"):])
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("success") is not True or not isinstance(doc.get("nodes"), list):
        return None
    return {str(n.get("node-id")): str(n.get("status", "")) for n in doc["nodes"] if isinstance(n, dict)}


def classify(returncode: int | None, stdout: str) -> Outcome:
    """``flwr supernode register --format json`` -> Outcome (None returncode: the try timed out)."""
    if returncode is None:
        return Outcome(False, transient=True, reason="timed out")
    try:
        doc = json.loads(stdout[stdout.index("{"):])
    except ValueError:
        doc = None
    if isinstance(doc, dict) and doc.get("success") is True and doc.get("node-id"):
        return Outcome(True, node_id=str(doc["node-id"]))
    text = str(doc.get("error-message", "")) if isinstance(doc, dict) else stdout
    line = " ".join(text.split())
    low = line.lower()
    if "already in use" in low or "already registered" in low:
        return Outcome(True)
    transient = any(w in low for w in ("connect", "unavailable", "timed out", "timeout", "503", "502",
                                       "connection reset", "temporarily"))
    reason = _USING.sub("", line).strip() or f"flwr exited {returncode}"
    return Outcome(False, transient=transient, reason=reason[-240:])


Runner = Callable[[str, float], Outcome]  # (device, timeout) -> outcome of one try


def register_all(devices: list[str], run: Runner, budget: Budget = Budget(),
                 sleep: Callable[[float], None] = time.sleep) -> dict[str, str]:
    """Register ``devices`` (``budget.workers`` at a time); device -> node id ("" when already known).

    Raises RegistrationFailed naming the first device (sorted) that failed and why.
    """
    def one(dev: str) -> Outcome:
        wait = budget.backoff_s
        out = Outcome(False, reason="not tried")
        for attempt in range(budget.attempts):
            out = run(dev, budget.try_s)
            if out.ok or not out.transient:
                return out
            if attempt + 1 < budget.attempts:
                log.info("registering SuperNode %s: %s; retrying in %.1f s", dev, out.reason, wait)
                sleep(wait)
                wait *= 2
        return out

    if not devices:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(budget.workers, len(devices)))) as pool:
        results = dict(zip(devices, pool.map(one, devices)))
    failed = sorted(d for d, o in results.items() if not o.ok)
    if failed:
        dev = failed[0]
        more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
        raise RegistrationFailed(f"could not register the SuperNode key of {dev} with the SuperLink: "
                                 f"{results[dev].reason}{more}")
    return {d: o.node_id for d, o in results.items()}


def load_ledger(path: Path) -> dict[str, str]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in doc.items()} if isinstance(doc, dict) else {}


def save_ledger(path: Path, ledger: Mapping[str, str]) -> None:
    atomic_write(path, json.dumps(dict(sorted(ledger.items())), indent=1))
