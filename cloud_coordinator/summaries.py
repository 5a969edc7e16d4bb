"""Fleet summaries from fog brokers: verified against the pinned fog key before anything is written.

A fog broker publishes its ``FleetSummary`` retained on ``Topics(site).summary()``,
sealed in an ``Envelope`` by the fog's Ed25519 identity. The coordinator
accepts one only if the envelope verifies under the fog key it was issued
with (``fog.json`` in its credentials), the sender is that fog, the summary
names the same fog and site, and the fog id is a plain name. Accepted
envelopes are stored as files named by the sha256 of the fog id (never by a
peer-chosen string joined into a path); the ServerApp re-verifies them when
it reads them. Retained messages have no freshness window: an older summary
never replaces a newer one, and selection ignores stale ones by timestamp.
"""
from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import codec
from runtime.errors import DecodeError, SecurityError
from runtime.ids import is_id
from runtime.messages import Envelope, FleetSummary
from runtime.security import TrustStore, Verifier

from .store import atomic_write

__all__ = ["open_summary", "summary_path", "read_summaries", "store_summary", "valid_fog_id", "SummaryInbox",
           "SiteKey", "read_site_summaries", "latest_summary",
           "WRONG_SENDER", "WRONG_FOG", "WRONG_SITE", "NOT_A_SUMMARY", "BAD_FOG_ID", "OLDER"]

log = logging.getLogger(__name__)

WRONG_SENDER = "sender is not the fog"
WRONG_FOG = "summary names another fog"
WRONG_SITE = "summary names another site"
NOT_A_SUMMARY = "not a summary"
BAD_FOG_ID = "invalid fog id"
OLDER = "older than the stored summary"
MAX_SUMMARY_BYTES = 4 * 1024 * 1024


def valid_fog_id(fog_id: str) -> bool:
    return is_id(fog_id)


def open_summary(payload: bytes | memoryview, fog_id: str, fog_key: bytes, site: str,
                 verifier: Verifier | None = None) -> tuple[Envelope, FleetSummary] | str:
    """The verified envelope and summary, or the fixed reason it is refused (never raises)."""
    if not valid_fog_id(fog_id):
        return BAD_FOG_ID
    v = verifier or Verifier(TrustStore({fog_id: fog_key}), max_size=MAX_SUMMARY_BYTES)
    try:
        env = codec.decode_envelope(payload, max_size=MAX_SUMMARY_BYTES)
        if env.sender != fog_id:
            return WRONG_SENDER
        msg = v.verify_only(env)  # retained: no freshness window (see the module doc)
    except SecurityError as exc:
        return exc.reason
    except DecodeError:
        return "malformed"
    if not isinstance(msg, FleetSummary):
        return NOT_A_SUMMARY
    if msg.fog_id != fog_id:
        return WRONG_FOG
    if msg.site != site:
        return WRONG_SITE
    return env, msg


def summary_path(out_dir: Path, fog_id: str) -> Path:
    """Where a fog's latest summary lives: named by a hash, so no fog id can choose the path."""
    return out_dir / f"{hashlib.sha256(fog_id.encode()).hexdigest()[:32]}.summary"


def store_summary(out_dir: Path, env: Envelope, summary: FleetSummary) -> str:
    """Keep the verified envelope unless a newer one is stored; '' or the reason it was not kept."""
    path = summary_path(out_dir, summary.fog_id)
    try:
        old = codec.decode(codec.decode_envelope(path.read_bytes()).payload)
        if isinstance(old, FleetSummary) and old.timestamp > summary.timestamp:
            return OLDER
    except (OSError, DecodeError):
        pass
    out_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, codec.encode(env), sync_dir=False)
    return ""


def read_summaries(out_dir: Path, fog_keys: Mapping[str, bytes], sites: Mapping[str, str]) -> list[FleetSummary]:
    """Every stored summary that still verifies under its fog's pinned key (the ServerApp's view)."""
    out: list[FleetSummary] = []
    for fog_id, key in sorted(fog_keys.items()):
        path = summary_path(out_dir, fog_id)
        try:
            data = path.read_bytes()
        except OSError:
            continue
        got = open_summary(data, fog_id, key, sites.get(fog_id, ""))
        if isinstance(got, str):
            log.warning("ignoring stored summary of %s: %s", fog_id, got)
            continue
        out.append(got[1])
    return out


class SummaryInbox:
    """One fog's summaries: verified against its pinned key, then stored in this site's own directory.

    ``on_summary`` runs on an MQTT worker thread; ``accepted`` and ``refused`` count what it did.
    A summary sealed by any other key (another site's fog included) is refused, whatever it says.
    """

    def __init__(self, fog: Any, out_dir: Path) -> None:  # fog: runtime.credentials.FogInfo
        self.fog = fog
        self.out_dir = out_dir
        self.verifier = Verifier(TrustStore({fog.fog_id: fog.public_key}), max_size=MAX_SUMMARY_BYTES)
        self.accepted = 0
        self.refused: Counter[str] = Counter()
        self.last_refusal = ""

    def on_summary(self, inbound: Any) -> None:
        got = open_summary(inbound.payload, self.fog.fog_id, self.fog.public_key, self.fog.site, self.verifier)
        if isinstance(got, str):
            self.refused[got] += 1
            self.last_refusal = got
            log.warning("refused a fleet summary on %s: %s", inbound.topic, got)
            return
        env, summary = got
        why = store_summary(self.out_dir, env, summary)
        if why:
            self.refused[why] += 1
            return
        self.accepted += 1


@dataclass(frozen=True, slots=True)
class SiteKey:
    """Where one site's summaries are and the fog key (and names) they must verify under."""

    summaries_dir: str
    fog_id: str
    fog_key: str   # hex
    fog_site: str

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SiteKey:
        return cls(str(d["summaries_dir"]), str(d["fog_id"]), str(d["fog_key"]), str(d["fog_site"]))


def latest_summary(key: SiteKey) -> FleetSummary | None:
    """The site's stored summary if it verifies under the site's own pinned key."""
    got = read_summaries(Path(key.summaries_dir), {key.fog_id: bytes.fromhex(key.fog_key)}, {key.fog_id: key.fog_site})
    return got[0] if got else None


def read_site_summaries(sites: Mapping[str, SiteKey]) -> list[FleetSummary]:
    """Every site's verified summary (the ServerApp's view of many sites): each checked with its own key."""
    out = []
    for name in sorted(sites):
        s = latest_summary(sites[name])
        if s is not None:
            out.append(s)
    return out
