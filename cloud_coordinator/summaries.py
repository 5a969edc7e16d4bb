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
import random
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime import codec
from runtime.errors import DecodeError, SecurityError
from runtime.ids import is_id
from runtime.messages import Envelope, FleetSummary
from runtime.security import TrustStore, Verifier

from .selection import (
    SELECTED,
    SelectionPolicy,
    explain,
    explain_devices,
    policy_named,
    select_clients,
)
from .settings import Settings
from .store import atomic_write

__all__ = ["Selector", "open_summary", "summary_path", "read_summaries", "store_summary", "valid_fog_id",
           "SummaryInbox", "SiteKey", "read_site_summaries", "latest_summary",
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


class Selector:
    """``RobustStrategy``'s selection collaborator: who may train this round, from the verified fleet
    summaries the fogs sealed (``selection``'s energy-aware policy); everyone when there are none."""

    def __init__(self, read_fleet: Callable[[], list[FleetSummary]], policy: SelectionPolicy, rule: str,
                 seed: int) -> None:
        self.read_fleet = read_fleet
        self.policy = policy
        self.rule = rule
        self.seed = seed
        self.last: dict[str, Any] | None = None  # the newest round's reasons (progress.json, fogline status)

    @classmethod
    def from_settings(cls, s: Settings, seed: int) -> Selector | None:
        """From ``fogline coordinator``'s settings (a bad rule name stops here, before any round)."""
        policy = policy_named(s.selection, s.battery_floor)
        if s.sites:
            keys = {name: SiteKey.from_json(d) for name, d in s.sites.items()}
            return cls(lambda: read_site_summaries(keys), policy, s.selection, seed)
        if s.summaries_dir and s.fog_keys:
            folder, fogs, sites = (Path(s.summaries_dir), {k: bytes.fromhex(v) for k, v in s.fog_keys.items()},
                                   dict(s.fog_sites))
            return cls(lambda: read_summaries(folder, fogs, sites), policy, s.selection, seed)
        return None

    def eligible(self, server_round: int, devices: dict[int, str]) -> tuple[dict[int, str], dict[str, str]]:
        """(node -> device of those who may train, device -> why not); seeded per round."""
        fleet = self.read_fleet()
        if not fleet:
            return devices, {}
        # random.Random: a numpy Generator has no sample() (a max_clients cap needs it)
        sel = select_clients(fleet, time.time(), self.policy, random.Random(f"{self.seed}/{server_round}"))
        log.info("round %d selection (%s): %s", server_round, self.rule, explain(sel))
        log.info("round %d selection by device: %s", server_round, explain_devices(sel))
        self.last = {"round": server_round, "rule": self.rule, "summary": explain(sel), "devices": dict(sel.reasons)}
        # A device no fog reports on is not excluded: the summaries can only say who cannot afford a round.
        unfit = {d: why for d, why in sel.reasons.items() if why != SELECTED}
        return {n: d for n, d in devices.items() if d not in unfit}, unfit
