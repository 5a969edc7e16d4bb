"""The sites one coordinator serves, from the command line or ``sites.toml``; checked before anything connects.

A site is a fog broker the coordinator reaches with credentials that fog
issued (``fogline operators add NAME --role coordinator --data-dir FOGDIR``):
its own TLS identity and signing key, and the fog's pinned key and MQTT
address (``fog.json``). Three ways to name them:

* ``--site NAME=CREDENTIALS_DIR`` (repeatable), ``NAME=DIR@HOST:PORT`` to dial
  another address than the one in ``fog.json``;
* ``--sites sites.toml``::

      [rollout]                      # optional: RolloutPolicy settings
      serve_timeout_s = 60
      [sites.store-1]
      credentials = "/etc/fogline/store-1"   # relative paths: to the file's directory
      mqtt = "10.0.1.2:8883"                 # optional
      canary = true
      order = 1                              # rollout order of the others (then file order)

* ``--mqtt HOST:PORT --credentials DIR``: one site, named after the fog's site.

The canary is ``--canary NAME``, else the site marked ``canary = true``, else
the first site. Every problem is one ``LocalViolation`` line naming the site.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

from runtime.credentials import Credentials, load_credentials
from runtime.errors import LocalViolation
from runtime.files import atomic_write
from runtime.ids import is_id
from runtime.mqtt import parse_hostport

from .rollout import RolloutPolicy

__all__ = ["SiteSpec", "SiteEndpoint", "SiteTable", "parse_site_arg", "specs_from_toml", "load_sites_toml", "resolve",
           "SITES_DIR", "TABLE_FILE", "STATUS_FILE", "ROLLOUTS_FILE", "valid_site_name", "save_table",
           "load_table", "summaries_dir_of"]

SITES_DIR = "sites"
TABLE_FILE = "sites/sites.json"     # the resolved table: what `fogline sites status|resume` read
STATUS_FILE = "sites/status.json"   # what the running coordinator last saw of each site
ROLLOUTS_FILE = "rollouts.json"     # the rollout book (cloud_coordinator.rollout)


def valid_site_name(name: str) -> bool:
    return is_id(name)


def summaries_dir_of(work_dir: Path, site: str) -> Path:
    """Where a site's verified summaries live: one directory per site, never shared."""
    return work_dir / "summaries" / site


@dataclass(frozen=True, slots=True)
class SiteSpec:
    """A site as the user named it (nothing loaded yet)."""

    name: str
    credentials: str
    mqtt: str = ""            # HOST:PORT; '' = the address in the credentials' fog.json
    canary: bool = False
    order: int | None = None

    def __post_init__(self) -> None:
        if not valid_site_name(self.name):
            raise LocalViolation(f"invalid site name {self.name!r} (letters, digits, . _ -; at most 64)")
        if not self.credentials:
            raise LocalViolation(f"site {self.name}: no credentials directory")
        if self.mqtt:
            try:
                parse_hostport(self.mqtt)
            except ValueError:
                raise LocalViolation(f"site {self.name}: {self.mqtt!r} is not HOST:PORT") from None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "credentials": self.credentials, "mqtt": self.mqtt, "canary": self.canary,
                "order": self.order}


def parse_site_arg(text: str) -> SiteSpec:
    """``NAME=CREDENTIALS_DIR`` or ``NAME=CREDENTIALS_DIR@HOST:PORT``."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise LocalViolation(f"--site {text!r}: expected NAME=CREDENTIALS_DIR[@HOST:PORT]")
    path, at, addr = rest.rpartition("@")
    if not at or ":" not in addr:  # an '@' inside the path, not an address
        path, addr = rest, ""
    return SiteSpec(name.strip(), str(Path(path).expanduser().resolve()), addr.strip())


def specs_from_toml(doc: Mapping[str, Any], base: Path, where: str = "sites.toml"
                    ) -> tuple[list[SiteSpec], dict[str, Any]]:
    """The ``[sites.NAME]`` tables and the ``[rollout]`` settings of a parsed sites.toml."""
    unknown = sorted(set(doc) - {"sites", "rollout"})
    if unknown:
        raise LocalViolation(f"{where}: unknown table {unknown[0]!r} (expected [sites.NAME] and [rollout])")
    sites = doc.get("sites")
    if not isinstance(sites, Mapping) or not sites:
        raise LocalViolation(f"{where}: no [sites.NAME] table")
    out = []
    for name, t in sites.items():
        if not isinstance(t, Mapping):
            raise LocalViolation(f"{where}: sites.{name} must be a table")
        extra = sorted(set(t) - {"credentials", "mqtt", "canary", "order"})
        if extra:
            raise LocalViolation(f"{where}: sites.{name}: unknown key {extra[0]!r} "
                                 "(credentials, mqtt, canary, order)")
        cred = t.get("credentials")
        if not isinstance(cred, str) or not cred:
            raise LocalViolation(f"{where}: sites.{name} needs credentials = \"DIR\"")
        canary, order = t.get("canary", False), t.get("order")
        if not isinstance(canary, bool) or (order is not None and (isinstance(order, bool) or
                                                                   not isinstance(order, int))):
            raise LocalViolation(f"{where}: sites.{name}: canary must be true/false and order an integer")
        mqtt = t.get("mqtt", "")
        if not isinstance(mqtt, str):
            raise LocalViolation(f"{where}: sites.{name}: mqtt must be \"HOST:PORT\"")
        p = Path(cred).expanduser()
        out.append(SiteSpec(str(name), str((p if p.is_absolute() else base / p).resolve()), mqtt, canary, order))
    rollout = doc.get("rollout", {})
    if not isinstance(rollout, Mapping):
        raise LocalViolation(f"{where}: [rollout] must be a table")
    return out, dict(rollout)


def load_sites_toml(path: Path) -> tuple[list[SiteSpec], dict[str, Any]]:
    try:
        doc = tomllib.loads(path.read_text())
    except OSError as exc:
        raise LocalViolation(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise LocalViolation(f"{path}: not TOML ({exc})") from None
    return specs_from_toml(doc, path.resolve().parent, str(path))


@dataclass(frozen=True, slots=True)
class SiteEndpoint:
    """A checked site: its spec, loaded credentials and the address to dial."""

    spec: SiteSpec
    creds: Credentials
    host: str
    port: int

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class SiteTable:
    """The sites in rollout order (the canary first) and the rollout policy."""

    sites: tuple[SiteEndpoint, ...]
    canary: str
    policy: RolloutPolicy

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sites]

    def get(self, name: str) -> SiteEndpoint:
        for s in self.sites:
            if s.name == name:
                return s
        raise LocalViolation(f"unknown site {name!r} (sites: {', '.join(self.names)})")


def _load(spec: SiteSpec) -> SiteEndpoint:
    try:
        creds = load_credentials(spec.credentials)
    except LocalViolation as exc:
        raise LocalViolation(f"site {spec.name}: {exc}") from None
    if creds.role != "coordinator":
        raise LocalViolation(f"site {spec.name}: {creds.dir} holds {creds.role!r} credentials ({creds.name}); a "
                             "coordinator needs its own: fogline operators add NAME --role coordinator "
                             "--data-dir FOGDIR on that site's fog")
    addr = spec.mqtt or creds.fog.mqtt
    if not addr:
        raise LocalViolation(f"site {spec.name}: {creds.dir}/fog.json names no MQTT address; give "
                             f"{spec.name}=DIR@HOST:PORT")
    try:
        host, port = parse_hostport(addr)
    except ValueError:
        raise LocalViolation(f"site {spec.name}: {addr!r} is not HOST:PORT") from None
    return SiteEndpoint(spec, creds, host, port)


def resolve(specs: Sequence[SiteSpec], canary: str | None = None,
            policy: RolloutPolicy | None = None) -> SiteTable:
    """Load and check every site; order them (canary first, then ``order``, then as given)."""
    if not specs:
        raise LocalViolation("no sites: give --site NAME=CREDENTIALS_DIR, --sites FILE or --mqtt with --credentials")
    seen: dict[str, SiteSpec] = {}
    for spec in specs:
        if spec.name in seen:
            raise LocalViolation(f"site {spec.name} is given twice")
        seen[spec.name] = spec
    if canary is not None and canary not in seen:
        raise LocalViolation(f"unknown site {canary!r} for --canary (sites: {', '.join(seen)})")
    marked = [spec.name for spec in specs if spec.canary]
    if canary is None and len(marked) > 1:
        raise LocalViolation(f"one canary site, not {len(marked)} ({', '.join(marked)} are marked canary = true)")
    sites = [_load(s) for s in specs]
    by_dir: dict[str, str] = {}
    by_key: dict[bytes, str] = {}
    by_ident: dict[tuple[str, str], str] = {}
    for s in sites:
        d = str(s.creds.dir.resolve())
        if d in by_dir:
            raise LocalViolation(f"sites {by_dir[d]} and {s.name} use the same credentials {d}: each site issues "
                                 "its own")
        by_dir[d] = s.name
        k = s.creds.fog.public_key
        if k in by_key:
            raise LocalViolation(f"sites {by_key[k]} and {s.name} pin the same fog key ({s.creds.fog.fog_id}): "
                                 "one fog cannot be two sites")
        by_key[k] = s.name
        ident = (s.creds.name, s.address)
        if ident in by_ident:  # the broker binds a client id to one connection
            raise LocalViolation(f"sites {by_ident[ident]} and {s.name} would both connect to {s.address} as "
                                 f"{s.creds.name}")
        by_ident[ident] = s.name
    first = canary or (marked[0] if marked else None)
    index = {s.name: i for i, s in enumerate(specs)}
    rest = sorted((s for s in sites if s.name != first),
                  key=lambda s: (s.spec.order if s.spec.order is not None else 1 << 30, index[s.name]))
    if first is None:
        first = rest.pop(0).name
    ordered = [next(s for s in sites if s.name == first), *rest]
    return SiteTable(tuple(ordered), first, policy or RolloutPolicy())


def save_table(work_dir: Path, table: SiteTable, *, insecure: bool = False) -> None:
    """Remember the sites for ``fogline sites status`` and ``fogline sites resume``."""
    path = work_dir / TABLE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"canary": table.canary, "insecure": insecure, "rollout": table.policy.to_dict(),
           "sites": [{**s.spec.to_json(), "fog_id": s.creds.fog.fog_id, "fog_site": s.creds.fog.site,
                      "fog_key": s.creds.fog.public_key.hex(), "identity": s.creds.name, "address": s.address}
                     for s in table.sites]}
    atomic_write(path, json.dumps(doc, indent=1))


def load_table(work_dir: Path) -> tuple[list[SiteSpec], str, dict[str, Any], bool, list[dict[str, Any]]]:
    """(specs, canary, rollout settings, insecure, raw rows) of the saved table; one line if there is none."""
    path = work_dir / TABLE_FILE
    try:
        doc = json.loads(path.read_text())
        rows = list(doc["sites"])
        specs = [SiteSpec(str(r["name"]), str(r["credentials"]), str(r.get("mqtt", "")), bool(r.get("canary")),
                          r.get("order")) for r in rows]
        return specs, str(doc["canary"]), dict(doc.get("rollout") or {}), bool(doc.get("insecure")), rows
    except FileNotFoundError:
        raise LocalViolation(f"no sites recorded in {work_dir} (run fogline coordinator or fogline sites release "
                             "with --site/--sites there first)") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise LocalViolation(f"{path} is unusable ({type(exc).__name__}: {exc})") from None
