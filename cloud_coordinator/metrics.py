"""Prometheus metrics of the cloud coordinator, read from its files when scraped.

The ServerApp runs in a process Flower spawns, and the site service keeps its
state in files, so nothing here is instrumented: ``CoordinatorWatch.snapshot()``
reads what the coordinator already writes into its checkpoint dir --

* the checkpoints of every replica (``ckpt-*.json`` + ``.bin``: each file
  verified once, checksum and signature, as a resume would; the newest
  verified one gives the round history: rounds, rejections, resumes),
* ``report.json`` of this run (the ServerApp's final report) and its ``progress.json``
  (the round in progress: its quorum, retries and current reply deadline),
* ``sites/sites.json``, ``sites/status.json``, each site's verified summary,
  ``rollouts.json``, the release outbox and ``releases/published.json``,

plus the two counts only this process sees (the supervisor's restarts, the
site service's loop errors) -- and ``families(snapshot)``, pure, turns that
into metric families. ``CoordinatorCollector`` is the thin ``prometheus_client``
collector over a watch (registered on its own ``CollectorRegistry``), and
``serve`` exposes it: plain HTTP on loopback (like ``fogline broker --insecure``),
anywhere else only over TLS with a client certificate that one of the sites'
CAs issued to a role holding the fog's ``status`` right (operator, coordinator,
monitor), the credentials Prometheus already scrapes each fog with.

Metric names and labels are listed in ``METRICS`` (the Grafana dashboard
``deploy/grafana/fogline-coordinator.json`` uses them; a test checks it).
"""
from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from runtime.metric_families import Families

__all__ = [
    "METRICS",
    "PREFIX",
    "ROLLOUT_STATES",
    "CoordinatorCollector",
    "CoordinatorWatch",
    "MetricsServer",
    "Source",
    "families",
    "rollout_site_state",
    "serve",
]

log = logging.getLogger("fogline.coordinator.metrics")

PREFIX = "fogline_coordinator"
STATUS_FRESH_S = 10.0        # sites/status.json is rewritten every 2 s while the site service runs
OBSERVE_EVERY_S = 2.0        # the supervisor's poll looks for new checkpoints at most this often
ROLLOUT_STATES = ("queued", "canary", "checking", "rolling", "done", "rolling back", "rolled back", "failed",
                  "waiting", "not released", "refused", "timeout", "skipped", "superseded", "unchanged")
STEPS = ("queued", "baseline", "canary", "switch", "probe", "rolling", "rollback", "done", "rolled back", "failed",
         "superseded", "unchanged")

# name (without the prefix) -> (type, labels, help). ``families`` emits nothing outside this table.
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "info": ("info", ("rule", "release", "checkpoint_mode"),
             "This coordinator: the aggregation rule it runs, its release name, its checkpoint mode"),
    "scrape_duration_seconds": ("gauge", (), "Time taken to read the coordinator's files for this scrape"),
    "uptime_seconds": ("gauge", (), "Seconds since this fogline coordinator process started"),
    "run_done": ("gauge", (), "1 once the ServerApp reported every round of this run done (report.json)"),
    "rounds_target": ("gauge", (), "Rounds the run is configured for"),
    "rounds_completed": ("counter", (), ("Rounds completed, as recorded by the newest verified checkpoint "
                                         "(or this run's final report)")),
    "round": ("gauge", (), "The round in progress (the last one once the run is done)"),
    "round_duration_seconds": ("gauge", (), ("Duration of the last completed round (two checkpoints of one run "
                                             "apart, or the final report)")),
    "round_clients": ("gauge", ("outcome",), ("Clients of the last completed round: sent, accepted, rejected, "
                                             "no_reply")),
    "rounds_skipped": ("counter", (), "Rounds that could not aggregate and kept the model"),
    "round_replies": ("gauge", (), "Usable replies of the last completed round (compare round_quorum)"),
    "round_quorum": ("gauge", (), "Usable replies a round needs to count (the rule's minimum for f, or min-replies)"),
    "round_retries": ("counter", (), ("Training attempts retried because they had no quorum (or failed to "
                                      "aggregate), over the run's rounds and the round in progress")),
    "round_deadline_seconds": ("gauge", (), ("Reply deadline of the current training attempt, adapted to earlier "
                                             "reply times (progress.json)")),
    "rejections": ("counter", ("rule", "reason"), ("Client updates rejected over the run, by aggregation rule and "
                                                   "reason: the checks before the rule and the rule's own "
                                                   "exclusions ('not selected')")),
    "model_metric": ("gauge", ("metric",), "Server-side evaluation of the global model after the last round"),
    "checkpoint_round": ("gauge", ("replica",), "Newest round whose checkpoint verifies in each replica"),
    "checkpoint_age_seconds": ("gauge", (), "Seconds since the newest verified checkpoint was written"),
    "checkpoints_written": ("counter", (), "Checkpoints this coordinator saw written (each round once)"),
    "checkpoint_resumes": ("counter", (), ("Runs that resumed from a checkpoint after a crash or restart, as the "
                                           "newest checkpoint records")),
    "checkpoint_verification_failures": ("counter", ("reason",), ("Checkpoint files seen failing verification "
                                                                  "(truncated, checksum, signature, ...), each "
                                                                  "file once")),
    "checkpoints_invalid": ("gauge", ("replica",), "Checkpoint files in each replica that do not verify now"),
    "releases_published": ("counter", ("release",), ("Releases written to the outbox (ServerApp or fogline sites "
                                                     "release), rollbacks not counted")),
    "release_version": ("gauge", ("release",), "Newest version of each release in the outbox"),
    "release_confirmations": ("counter", ("release", "site"), ("Versions of each release a site confirmed "
                                                               "(releases/published.json)")),
    "rollbacks": ("counter", ("release",), "Rollback releases published (the previous model as a new version)"),
    "rollout_version": ("gauge", ("release",), "Version of each release's newest rollout"),
    "rollout_step": ("gauge", ("release", "step"), "1 for the step of each release's newest rollout"),
    "rollout_state": ("gauge", ("release", "site", "state"), ("1 for the state of each release's newest rollout "
                                                              "at each site: " + ", ".join(ROLLOUT_STATES))),
    "rollouts": ("gauge", ("step",), "Rollouts kept in rollouts.json, by step (the newest 100 finished ones)"),
    "site_info": ("info", ("site", "role", "address", "fog_id"), "Each site: its role (canary or #order), address"),
    "site_reachable": ("gauge", ("site",), ("1 when the site's fog answered the last status request, 0 when not "
                                            "(absent while the site service is not running)")),
    "site_last_seen_age_seconds": ("gauge", ("site",), "Seconds since the site's fog last answered"),
    "site_summary_age_seconds": ("gauge", ("site",), "Age of the site's newest verified fleet summary"),
    "site_devices": ("gauge", ("site", "state"), ("Devices in the site's newest verified fleet summary: live, "
                                                  "fit (live and fit for training), total")),
    "site_summaries": ("counter", ("site", "outcome"), ("Fleet summaries from each site's fog: accepted, or "
                                                        "the reason one was refused")),
    "sites_status_age_seconds": ("gauge", (), "Seconds since the site service last wrote sites/status.json"),
    "supervisor_restarts": ("counter", ("component",), ("Restarts by the supervisor: run (a new flwr run), "
                                                        "superlink (the SuperLink restarted), superexec and "
                                                        "serverapp (by the watchdog)")),
    "site_service_errors": ("counter", (), "Exceptions in the site service's loop (logged)"),
}


# ------------------------------------------------------------------ pure: snapshot -> families


def _families() -> Families:
    return Families(PREFIX, METRICS)


def _name(short: str) -> str:
    return f"{PREFIX}_{short}"


def _reason(why: str) -> str:
    """A rejection reason without its detail ('bad array: shape ...' -> 'bad array'): bounded label values."""
    return str(why).split(":", 1)[0].strip() or "unknown"


def rollout_site_state(r: Mapping[str, Any], site: str) -> str:
    """One site's state in one rollout (``ROLLOUT_STATES``): the canary's from the step, the others' own."""
    step = str(r.get("step", "queued"))
    if step in ("queued", "superseded", "unchanged"):
        return step
    if site == r.get("canary"):
        return {"baseline": "canary", "canary": "canary", "switch": "checking", "probe": "checking",
                "rollback": "rolling back", "rolled back": "rolled back", "failed": "failed"}.get(step, "done")
    st = str(((r.get("sites") or {}).get(site) or {}).get("state", "waiting"))
    if st == "accepted":
        return "done"
    if st == "published":
        return "rolling"
    if st in ("refused", "timeout", "skipped"):
        return st
    return "not released" if step in ("rollback", "rolled back", "failed", "done") else "waiting"


def families(snap: Mapping[str, Any]) -> list[Metric]:
    """The metric families of one snapshot (pure: no I/O, no clock; ``snap["now"]`` is the time)."""
    f = _families()
    now = float(snap["now"])
    cfg: Mapping[str, Any] = snap.get("config") or {}
    f.get("info").add_metric([], {"rule": str(cfg.get("rule", "")), "release": str(cfg.get("release", "")),
                                  "checkpoint_mode": str(cfg.get("checkpoint_mode", ""))})
    if snap.get("started_at") is not None:
        f.add("uptime_seconds", max(0.0, now - float(snap["started_at"])))
    _rounds(f, snap, now, str(cfg.get("rule", "")))
    _checkpoints(f, snap, now)
    _releases(f, snap)
    _sites(f, snap, now)
    restarts = snap.get("restarts")
    f.get("supervisor_restarts")
    if restarts is not None:
        for component in ("run", "superlink", "superexec", "serverapp"):
            f.add("supervisor_restarts", int(restarts.get(component, 0)), component)
    if snap.get("site_service_errors") is not None:
        f.add("site_service_errors", int(snap["site_service_errors"]))
    return f.in_table_order()


def _rounds(f: Families, snap: Mapping[str, Any], now: float, rule: str) -> None:
    ck: Mapping[str, Any] = snap.get("checkpoint") or {}
    report: Mapping[str, Any] | None = snap.get("report")
    done = bool(report and report.get("done"))
    history: Sequence[Mapping[str, Any]] = (report or {}).get("history") or ck.get("history") or ()
    completed = int(report.get("rounds_done", 0)) if done and report else int(ck.get("round", 0))
    target = snap.get("rounds_target") or (report or {}).get("rounds")
    f.add("run_done", 1 if done else 0)
    if target:
        f.add("rounds_target", int(target))
    f.add("rounds_completed", completed)
    f.add("round", completed if done or (target and completed >= int(target)) else completed + 1)
    dur = None
    if done and report and report.get("round_s"):
        dur = float(report["round_s"][-1])
    elif ck.get("round_duration_s") is not None:
        dur = float(ck["round_duration_s"])
    if dur is not None:
        f.add("round_duration_seconds", dur)
    rejections: dict[tuple[str, str], int] = {}
    skipped = 0
    for h in history:
        skipped += 1 if h.get("skipped") else 0
        for why in (h.get("rejected") or {}).values():
            key = (str(h.get("rule") or rule), _reason(why))
            rejections[key] = rejections.get(key, 0) + 1
    f.add("rounds_skipped", skipped)
    progress: Mapping[str, Any] = snap.get("progress") or {}
    last_h: Mapping[str, Any] = history[-1] if history else {}
    if last_h.get("replies") is not None:
        f.add("round_replies", int(last_h["replies"]))
    quorum = progress.get("quorum", last_h.get("quorum"))
    if quorum is not None:
        f.add("round_quorum", int(quorum))
    retries = sum(len(h.get("retried") or ()) for h in history)
    if progress and not any(h.get("round") == progress.get("round") for h in history):
        retries += int(progress.get("retries", 0))  # the round in progress: not in the history yet
    f.add("round_retries", retries)
    if progress.get("deadline_s") is not None:
        f.add("round_deadline_seconds", float(progress["deadline_s"]))
    f.get("rejections")
    for (r, why), n in sorted(rejections.items()):
        f.add("rejections", n, r, why)
    if history:
        last = history[-1]
        sent = list(last.get("clients") or ())
        for outcome, n in (("sent", len(sent)), ("accepted", len(last.get("accepted") or ())),
                           ("rejected", len(last.get("rejected") or {})),
                           ("no_reply", len(last.get("no_reply") or ()))):
            f.add("round_clients", n, outcome)
        for k, v in sorted((last.get("server") or {}).items()):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                f.add("model_metric", v, str(k))


def _checkpoints(f: Families, snap: Mapping[str, Any], now: float) -> None:
    ck: Mapping[str, Any] = snap.get("checkpoint") or {}
    for replica, r in sorted((snap.get("replicas") or {}).items()):
        if r.get("round") is not None:
            f.add("checkpoint_round", int(r["round"]), replica)
        f.add("checkpoints_invalid", int(r.get("invalid", 0)), replica)
    if ck.get("created") is not None:
        f.add("checkpoint_age_seconds", max(0.0, now - float(ck["created"])))
    f.add("checkpoints_written", int(snap.get("checkpoints_written", 0)))
    f.add("checkpoint_resumes", int((ck.get("extra") or {}).get("restarts", 0)))
    f.get("checkpoint_verification_failures")
    for why, n in sorted((snap.get("verification_failures") or {}).items()):
        f.add("checkpoint_verification_failures", n, why)


def _releases(f: Families, snap: Mapping[str, Any]) -> None:
    book: Mapping[str, Any] = snap.get("book") or {}
    rollouts: list[Mapping[str, Any]] = list(book.get("rollouts") or ())
    rollbacks = {(str(r["name"]), int(r["rollback"]["as_version"])) for r in rollouts if r.get("rollback")}
    outbox: Mapping[str, Sequence[int]] = snap.get("outbox") or {}
    for name in sorted(set(outbox) | {n for n, _ in rollbacks}):
        versions = [int(v) for v in outbox.get(name, ())]
        own = [v for v in versions if (name, v) not in rollbacks]
        f.add("releases_published", len(own), name)
        if versions:
            f.add("release_version", max(versions), name)
        f.add("rollbacks", sum(1 for v in versions if (name, v) in rollbacks), name)
    confirmed: dict[tuple[str, str], int] = {}
    for entry in (snap.get("published") or {}).values():
        if entry.get("rollback_of") is not None:
            continue
        for site in entry.get("sites") or ():
            key = (str(entry.get("workload", "")), str(site))
            confirmed[key] = confirmed.get(key, 0) + 1
    f.get("release_confirmations")
    for (name, site), n in sorted(confirmed.items()):
        f.add("release_confirmations", n, name, site)
    steps = dict.fromkeys(STEPS, 0)
    newest: dict[str, Mapping[str, Any]] = {}
    for r in rollouts:
        steps[str(r["step"])] = steps.get(str(r["step"]), 0) + 1
        cur = newest.get(str(r["name"]))
        if cur is None or int(r["version"]) >= int(cur["version"]):
            newest[str(r["name"])] = r
    for step, n in steps.items():
        f.add("rollouts", n, step)
    sites = [str(s["name"]) for s in snap.get("sites") or ()] or list(book.get("sites") or ())
    f.get("rollout_state")
    for name, r in sorted(newest.items()):
        f.add("rollout_version", int(r["version"]), name)
        for step in STEPS:
            f.add("rollout_step", 1 if r["step"] == step else 0, name, step)
        for site in [r.get("canary", ""), *[s for s in sites if s != r.get("canary")]]:
            if not site:
                continue
            state = rollout_site_state(r, str(site))
            for s in ROLLOUT_STATES:
                f.add("rollout_state", 1 if s == state else 0, name, str(site), s)


def _sites(f: Families, snap: Mapping[str, Any], now: float) -> None:
    status: Mapping[str, Any] = snap.get("status") or {}
    at = status.get("at")
    fresh = at is not None and now - float(at) < STATUS_FRESH_S and not status.get("stopped")
    if at is not None:
        f.add("sites_status_age_seconds", max(0.0, now - float(at)))
    live = status.get("sites") or {}
    canary = snap.get("canary")
    for i, row in enumerate(snap.get("sites") or ()):
        name = str(row["name"])
        f.get("site_info").add_metric([], {"site": name, "role": "canary" if name == canary else f"#{i}",
                                           "address": str(row.get("address") or ""),
                                           "fog_id": str(row.get("fog_id") or "")})
        info = live.get(name) or {}
        if fresh:
            f.add("site_reachable", 1 if info.get("reachable") else 0, name)
        if info.get("last_contact_at") is not None:
            f.add("site_last_seen_age_seconds", max(0.0, now - float(info["last_contact_at"])), name)
        summ = (snap.get("summaries") or {}).get(name)
        if summ is not None:
            f.add("site_summary_age_seconds", max(0.0, now - float(summ["at"])), name)
            for state in ("live", "fit", "total"):
                f.add("site_devices", int(summ[state]), name, state)
        counts = info.get("summaries") or {}
        if counts:
            f.add("site_summaries", int(counts.get("accepted", 0)), name, "accepted")
            for why, n in sorted((counts.get("refused") or {}).items()):
                f.add("site_summaries", int(n), name, str(why))


# ------------------------------------------------------------------ I/O: the coordinator's files -> snapshot


@dataclass(frozen=True, slots=True)
class Source:
    """Where the coordinator keeps its state, and what only its command line knows."""

    work_dir: Path
    checkpoint_dirs: tuple[Path, ...] = ()
    trusted_key: bytes | None = None      # checkpoints are verified under it (the coordinator's signing key)
    rule: str = ""
    release: str = ""
    checkpoint_mode: str = ""
    rounds_target: int | None = None
    started_at: float = field(default_factory=time.time)  # an older report.json is a previous run's


def _stat(p: Path) -> tuple[int, int] | None:
    try:
        st = p.stat()
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size


def _read_json(p: Path) -> Any:
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _payload_meta(payload: bytes) -> dict[str, Any]:
    """Round, history and extra of a checkpoint payload, its arrays skipped (never decoded or copied)."""
    import msgpack

    def ext(code: int, data: bytes) -> Any:
        return int(data.decode()) if code == 8 else None  # 8: an int beyond 64 bits; 7: an array (skipped)

    d = msgpack.unpackb(payload, ext_hook=ext, raw=False, strict_map_key=False)
    return {"round": int(d["round"]), "history": list(d.get("history") or ()), "extra": dict(d.get("extra") or {})}


class CoordinatorWatch:
    """Reads the coordinator's state; remembers what it verified, so each checkpoint file is read once.

    ``observe()`` (cheap when nothing changed) notes new checkpoints, for the
    supervisor's poll: a checkpoint written and pruned between two scrapes is
    still counted. ``snapshot()`` is everything ``families`` needs. Thread-safe.
    """

    def __init__(self, source: Source, *, supervisor: Any = None, service: Any = None) -> None:
        self.source = source
        self.supervisor = supervisor   # launcher.Supervisor: its restarts
        self.service = service         # siteservice.SiteService: its loop errors
        self._lock = threading.Lock()
        self._store: Any = None
        self._files: dict[tuple[int, int], tuple[tuple[Any, ...], Any]] = {}  # (replica, round) -> (stats, result)
        self._meta: dict[str, dict[str, Any]] = {}      # sha256 -> payload meta + created
        self._written: set[str] = set()                 # sha256 of every verified checkpoint seen
        self._failed: dict[tuple[Any, ...], str] = {}   # (replica, round, stats) -> reason
        self._summaries: dict[str, tuple[Any, dict[str, Any] | None]] = {}
        self._last_observe = -math.inf

    # -------------------------------------------------------------- checkpoints

    def _checkpoint_store(self) -> Any:
        if self._store is None and self.source.checkpoint_dirs:
            from .store import CheckpointStore

            self._store = CheckpointStore(self.source.checkpoint_dirs, trusted_key=self.source.trusted_key)
        return self._store

    def _scan(self) -> dict[tuple[int, int], Any]:
        """(replica, round) -> ReplicaEntry of every checkpoint file now present (new files verified)."""
        store = self._checkpoint_store()
        if store is None:
            return {}
        out: dict[tuple[int, int], Any] = {}
        for i, d in enumerate(store.dirs):
            for r in store.rounds_in(d):
                stem = d / f"ckpt-{r:08d}"
                stats = (_stat(stem.with_suffix(".json")), _stat(stem.with_suffix(".bin")))
                hit = self._files.get((i, r))
                if hit is not None and hit[0] == stats:
                    out[(i, r)] = hit[1]
                    continue
                entry, payload = store.verify(i, r)
                if not entry.ok and _stat(stem.with_suffix(".json")) is None:
                    continue  # pruned (or a save that missed its quorum removed it) while we looked
                if entry.ok and payload is not None and entry.sha256 not in self._meta:
                    try:
                        meta = _payload_meta(payload)
                    except Exception as exc:  # noqa: BLE001 - verified yet unreadable: say so, keep scraping
                        log.warning("checkpoint %s: %s", stem, exc)
                        meta = {"round": r, "history": [], "extra": {}}
                    manifest = _read_json(stem.with_suffix(".json")) or {}
                    meta["created"] = manifest.get("created")
                    self._meta[entry.sha256] = meta
                if entry.ok:
                    self._written.add(entry.sha256)
                else:
                    self._failed[(i, r, stats)] = entry.reason
                self._files[(i, r)] = (stats, entry)
                out[(i, r)] = entry
        for key in set(self._files) - set(out):
            del self._files[key]
        live = {e.sha256 for e in out.values() if e.ok}
        for sha in set(self._meta) - live:
            del self._meta[sha]
        return out

    def observe(self, now: float | None = None) -> None:
        """Note new checkpoints (the supervisor calls this every poll; it acts every ``OBSERVE_EVERY_S``)."""
        now = time.monotonic() if now is None else now
        if now - self._last_observe < OBSERVE_EVERY_S:
            return
        self._last_observe = now
        try:
            with self._lock:
                self._scan()
        except Exception:
            log.exception("coordinator metrics: checkpoint scan")

    def _checkpoint_part(self) -> dict[str, Any]:
        entries = self._scan()
        store = self._checkpoint_store()
        replicas: dict[str, dict[str, Any]] = {}
        if store is not None:
            for i, d in enumerate(store.dirs):
                mine = [e for (j, _), e in entries.items() if j == i]
                ok = [e.server_round for e in mine if e.ok]
                replicas[str(d)] = {"round": max(ok) if ok else None, "invalid": sum(1 for e in mine if not e.ok)}
        metas = sorted(self._meta.values(), key=lambda m: m["round"], reverse=True)
        ck: dict[str, Any] | None = None
        if metas:
            ck = dict(metas[0])
            run = ck["extra"].get("restarts")
            for prev in metas[1:]:  # the same run (same resume count): elapsed time only grows within it
                if prev["extra"].get("restarts") == run and prev["round"] < ck["round"]:
                    gap = float(ck["extra"].get("elapsed_s", 0.0)) - float(prev["extra"].get("elapsed_s", 0.0))
                    if gap > 0:
                        ck["round_duration_s"] = gap / (ck["round"] - prev["round"])
                    break
        failures: dict[str, int] = {}
        for why in self._failed.values():
            failures[why] = failures.get(why, 0) + 1
        return {"checkpoint": ck, "replicas": replicas, "checkpoints_written": len(self._written),
                "verification_failures": failures}

    # -------------------------------------------------------------- sites and releases

    def _summary(self, work: Path, row: Mapping[str, Any]) -> dict[str, Any] | None:
        from .sites import summaries_dir_of
        from .summaries import SiteKey, latest_summary

        d = summaries_dir_of(work, str(row["name"]))
        try:
            stats = tuple(sorted((p.name, _stat(p)) for p in d.iterdir()))
        except OSError:
            return None
        hit = self._summaries.get(str(row["name"]))
        if hit is not None and hit[0] == stats:
            return hit[1]
        summ = latest_summary(SiteKey(str(d), str(row["fog_id"]), str(row["fog_key"]), str(row["fog_site"])))
        got = None if summ is None else {
            "at": float(summ.timestamp), "live": sum(1 for x in summ.devices if x.alive),
            "fit": sum(1 for x in summ.devices if x.alive and x.fit_for_training), "total": len(summ.devices)}
        self._summaries[str(row["name"])] = (stats, got)
        return got

    def _outbox(self, work: Path) -> dict[str, list[int]]:
        from .settings import RELEASES_DIR

        out: dict[str, list[int]] = {}
        d = work / RELEASES_DIR
        if d.is_dir():
            for p in d.glob("*.release"):
                name, sep, v = p.stem.rpartition("-v")
                if sep and v.isdigit():
                    out.setdefault(name, []).append(int(v))
        return out

    def _sites_part(self) -> dict[str, Any]:
        from .settings import RELEASES_DIR
        from .sites import ROLLOUTS_FILE, STATUS_FILE, TABLE_FILE
        from .siteservice import PUBLISHED_FILE

        work = self.source.work_dir
        table = _read_json(work / TABLE_FILE) or {}
        rows = [r for r in table.get("sites") or () if isinstance(r, dict) and "name" in r]
        summaries = {}
        for row in rows:
            try:
                summaries[str(row["name"])] = self._summary(work, row)
            except (KeyError, ValueError):
                summaries[str(row["name"])] = None
        return {"sites": rows, "canary": table.get("canary"), "status": _read_json(work / STATUS_FILE),
                "summaries": summaries, "book": _read_json(work / ROLLOUTS_FILE),
                "published": _read_json(work / RELEASES_DIR / PUBLISHED_FILE), "outbox": self._outbox(work)}

    # -------------------------------------------------------------- all of it

    def snapshot(self, now: float | None = None) -> dict[str, Any]:
        """What one scrape needs, as plain data (``families`` turns it into metrics)."""
        from .settings import PROGRESS_FILE, REPORT_FILE

        src = self.source
        now = time.time() if now is None else now
        report = _read_json(src.work_dir / REPORT_FILE)
        if not isinstance(report, dict) or float(report.get("finished_at", 0)) < src.started_at:
            report = None
        progress = _read_json(src.work_dir / PROGRESS_FILE)
        if not isinstance(progress, dict) or float(progress.get("at", 0)) < src.started_at:
            progress = None  # an earlier run's
        with self._lock:  # scrapes may overlap: one reads the files at a time
            snap: dict[str, Any] = {
                "now": now, "started_at": src.started_at, "rounds_target": src.rounds_target, "report": report,
                "progress": progress,
                "config": {"rule": src.rule, "release": src.release, "checkpoint_mode": src.checkpoint_mode},
                **self._checkpoint_part(), **self._sites_part()}
        sup = self.supervisor
        if sup is not None:
            snap["restarts"] = {"run": int(sup.restarts),
                                "superlink": max(0, int(sup.generation) - 1) if sup.owned else 0,
                                **{k: int(v) for k, v in getattr(sup, "component_restarts", {}).items()
                                   if k != "superlink"}}
        if self.service is not None:
            snap["site_service_errors"] = int(self.service.failures)
        return snap


class CoordinatorCollector:
    """A ``prometheus_client`` collector over a ``CoordinatorWatch`` (reads the files when scraped)."""

    def __init__(self, watch: CoordinatorWatch) -> None:
        self.watch = watch

    def collect(self) -> Iterator[Metric]:
        t0 = time.monotonic()
        fams = families(self.watch.snapshot())
        dur = GaugeMetricFamily(_name("scrape_duration_seconds"), METRICS["scrape_duration_seconds"][2])
        dur.add_metric([], time.monotonic() - t0)
        yield from fams
        yield dur

    def describe(self) -> list[Metric]:
        return []  # nothing to check at registration: the names are fixed by METRICS


# ------------------------------------------------------------------ serving


def _metric_roles() -> frozenset[str]:
    """The roles the fog lets read its /metrics (the ``status`` right): the same here."""
    from fog_broker.trust import CONTROL_RIGHTS

    return frozenset(role for role, rights in CONTROL_RIGHTS.items() if "status" in rights)


@dataclass(slots=True)
class MetricsServer:
    """A running exporter: ``address`` it listens on, ``close()`` to stop it."""

    address: tuple[str, int]
    tls: bool
    _server: Any
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


def serve(watch: CoordinatorWatch, port: int, host: str = "127.0.0.1", *,
          client_cas: Sequence[Path] = (), work_dir: Path | None = None,
          server_names: Sequence[str] = ()) -> MetricsServer:
    """Serve ``GET /metrics`` from a registry of its own (nothing of the global one).

    Loopback: plain HTTP. Any other address: TLS with a certificate from the
    coordinator's own CA (the SuperLink's, ``work_dir/superlink-tls``: Prometheus
    trusts its ``ca.pem``; the certificate, for ``host`` and ``server_names``, goes to
    ``work_dir/metrics-tls``), and only clients presenting a certificate from one of
    ``client_cas`` (the sites' CAs) whose role (OU) holds the fog's ``status``
    right; anything else is a ``LocalViolation`` before a socket is opened.
    Revocations stay with each site's fog (its CRL): revoke there and remove the
    site here, or rotate the site's CA.
    """
    import socket
    import ssl
    import sys
    from wsgiref.simple_server import WSGIRequestHandler, make_server

    from prometheus_client import CollectorRegistry, make_wsgi_app
    from prometheus_client.exposition import ThreadingWSGIServer

    from runtime.errors import LocalViolation
    from runtime.net import is_loopback

    registry = CollectorRegistry(auto_describe=False)
    registry.register(CoordinatorCollector(watch))
    app = make_wsgi_app(registry)
    secure = not is_loopback(host)
    ctx = None
    if secure:
        if not client_cas or work_dir is None:
            raise LocalViolation(f"--metrics-host {host}: metrics leave this machine only over TLS with client "
                                 "certificates of a site's CA, so the coordinator needs sites (--site/--sites or "
                                 "--mqtt); otherwise keep the default 127.0.0.1")
        import ipaddress

        from runtime.pki import SiteCA

        from .launcher import TLS_DIR

        hosts, ips = {"localhost"}, {"127.0.0.1"}
        for name in (host, *server_names):
            try:
                if not ipaddress.ip_address(name).is_unspecified:
                    ips.add(name)
            except ValueError:
                hosts.add(name)
        ca = SiteCA.load_or_create(work_dir / TLS_DIR, "superlink")
        out = work_dir / "metrics-tls"
        ca.ensure_server_cert(out, hosts, ips)
        bundle = b"".join(Path(p).read_bytes() for p in client_cas)
        (out / "client-cas.pem").write_bytes(bundle)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(str(out / "broker.pem"), str(out / "broker.key"))
        ctx.load_verify_locations(cafile=str(out / "client-cas.pem"))
        ctx.verify_mode = ssl.CERT_REQUIRED
    roles = _metric_roles()

    class Handler(WSGIRequestHandler):
        timeout = 10.0  # a client that stalls (in the TLS handshake too) holds one thread, for this long

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def get_environ(self) -> dict[str, Any]:
            env = super().get_environ()
            peer = getattr(self.connection, "getpeercert", None)
            env["fogline.peercert"] = peer() if peer is not None else None
            return env

    def guarded(environ: dict[str, Any], start_response: Any) -> Any:
        if secure:
            cert = environ.get("fogline.peercert") or {}
            subject = {k: v for rdn in cert.get("subject", ()) for k, v in rdn}
            if subject.get("organizationalUnitName") not in roles:
                start_response("403 Forbidden", [("Content-Type", "text/plain")])
                return [f"a {', '.join(sorted(roles))} certificate is needed\n".encode()]
        return app(environ, start_response)

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

        def handle_error(self, request: Any, client_address: Any) -> None:
            log.debug("metrics: %s: %s", client_address, sys.exc_info()[1])  # a refused handshake, a reset

    httpd = make_server(host, port, guarded, Server, handler_class=Handler)
    if ctx is not None:
        # the handshake runs in the request's thread (on its first read), not in the accepting one
        httpd.socket = ctx.wrap_socket(httpd.socket, server_side=True, do_handshake_on_connect=False)
    thread = threading.Thread(target=httpd.serve_forever, name="coordinator-metrics", daemon=True)
    thread.start()
    addr = httpd.server_address
    log.info("coordinator metrics on %s://%s:%d/metrics", "https" if secure else "http", addr[0], addr[1])
    return MetricsServer((str(addr[0]), int(addr[1])), secure, httpd, thread)
