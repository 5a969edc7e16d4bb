"""The coordinator's sites at run time: one ``SiteLink`` per site, the rollout book, the release outbox.

One owner thread holds the ``RolloutBook`` (the pure core): it feeds it the
links' events and the outbox's new releases, with ``time.monotonic()`` as
``now``, and carries out its commands:

* ``Publish(site, name, version)``: the outbox file, re-signed with that
  site's coordinator identity (each fog pins the key it issued), handed to
  the site's link;
* ``Probe``: the held-out batch, run by the canary's link;
* ``Restore``: the previous model's bytes written to the outbox as a new,
  higher version (metadata ``rollback-of``/``restores``), which is how a
  rollback gets past fogs that accept only increasing versions.

Site autonomy: the book's clock (``RolloutClock``) stands still while the
canary under check is cut off (it answered, then its link went quiet), up to
``outage_grace_s`` per outage. A WAN cut is no verdict on a release: without
this a cut longer than a step's timeout would fail a release the canary
never saw, or roll back one it had accepted. The release and the canary's
acknowledgement (its ``status`` listing the version) go through once the
link is back; a held-out batch the cut interrupted (``ProbeCut``) is run
again then. A site cut while the release rolls on to the others is not
waited for: it times out, the others get the release, and it catches up
when it answers again (``RolloutBook._catch_up``).

After every change the book is saved (``CKPT/rollouts.json``, atomically):
a restarted coordinator resumes a rollout where it stopped.
``CKPT/sites/status.json`` says what each site last answered, for
``fogline sites status``; ``releases/published.json`` lists what each site
confirmed.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import threading
import time
from pathlib import Path
from typing import Any

from runtime import codec
from runtime.errors import LocalViolation
from runtime.files import atomic_write
from runtime.security import Identity

from .release import ReleaseError, build_release, read_release, release_path
from .rollout import (
    RESTORES_KEY,
    ROLLBACK_KEY,
    Command,
    NewRelease,
    Note,
    Probe,
    Publish,
    Restore,
    Restored,
    RestoreFailed,
    RolloutBook,
    RolloutClock,
    Seen,
    Step,
    awaited_site,
    held_site,
)
from .settings import RELEASES_DIR
from .sitelink import ProbeCut, RunProbe, SendRelease, SiteLink
from .sites import ROLLOUTS_FILE, STATUS_FILE, SiteTable, summaries_dir_of

__all__ = ["SiteService", "PUBLISHED_FILE", "load_book"]

log = logging.getLogger("fogline.sites")
PUBLISHED_FILE = "published.json"
_SIGNED_KEYS = ("workload", "version", "format")  # build_release sets these itself


def load_book(work_dir: Path, table: SiteTable) -> tuple[RolloutBook, set[str] | None]:
    """The saved book (or a new one) and, for a new one, the outbox files an older coordinator published."""
    path = work_dir / ROLLOUTS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        try:
            legacy = set(json.loads((work_dir / RELEASES_DIR / PUBLISHED_FILE).read_text()))
        except (OSError, ValueError, TypeError):
            legacy = set()
        return RolloutBook(table.names, table.canary, table.policy), legacy
    except OSError as exc:
        raise LocalViolation(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        return RolloutBook.from_json(json.loads(text), table.names, table.canary, table.policy), None
    except ValueError as exc:
        raise LocalViolation(f"{path} is unreadable ({exc}); it was left untouched: move it away to start a new "
                             "rollout history") from None


class SiteService:
    """Starts the links and the owner thread; ``drain`` waits for rollouts, ``stop`` saves and closes."""

    def __init__(self, work_dir: Path, table: SiteTable, signer: Identity, *, insecure: bool = False,
                 poll_s: float = 5.0, fast_poll_s: float = 0.5, outage_grace_s: float | None = None) -> None:
        self.work = work_dir
        self.outbox = work_dir / RELEASES_DIR
        self.table = table
        self.signer = signer
        self.events: queue.Queue[Any] = queue.Queue()
        self.book, self._legacy = load_book(work_dir, table)
        self._before = {(r.name, r.version): r.step for r in self.book.rollouts}
        self.links = {s.name: SiteLink(s, summaries_dir_of(work_dir, s.name), self.events, insecure=insecure,
                                       poll_s=poll_s, fast_poll_s=fast_poll_s) for s in table.sites}
        self.notes: list[tuple[str, str]] = []
        self.clock = RolloutClock(table.policy.outage_grace_s if outage_grace_s is None else outage_grace_s)
        self._cut_probes: dict[str, Probe] = {}   # site -> the held-out batch a cut interrupted (run again)
        self.failures = 0             # exceptions in the owner loop (logged)
        self._frames: dict[tuple[str, str, int], bytes] = {}
        self._bad_files: set[str] = set()
        self._lock = threading.Lock()
        self._snapshot: dict[str, Any] = self.book.to_json()
        self._busy = True             # until the first loop has scanned the outbox
        self._scan_asked = 0
        self._scanned = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="site-service", daemon=True)

    # ------------------------------------------------------------ lifecycle (any thread)

    def start(self) -> SiteService:
        self.work.mkdir(parents=True, exist_ok=True)
        for link in self.links.values():
            link.start()
        self._thread.start()
        return self

    def drain(self, timeout_s: float) -> bool:
        """Wait until every release in the outbox has finished its rollout; False at the timeout."""
        with self._lock:
            self._scan_asked += 1
            want = self._scan_asked
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self._thread.is_alive():
            with self._lock:
                if self._scanned >= want and not self._busy:
                    return True
            time.sleep(0.2)
        with self._lock:
            return self._scanned >= want and not self._busy

    def stop(self) -> None:
        self._stop.set()
        if self._thread.ident is not None:
            self._thread.join(30)
        for link in self.links.values():
            link.stop()
        self._write_status(stopped=True)

    def snapshot(self) -> dict[str, Any]:
        """The book as last saved (any thread)."""
        with self._lock:
            doc: dict[str, Any] = json.loads(json.dumps(self._snapshot))
        return doc

    def outcomes(self) -> list[dict[str, Any]]:
        """The rollouts this process moved, as saved."""
        return [r for r in self.snapshot()["rollouts"]
                if self._before.get((r["name"], r["version"])) != Step(r["step"])]

    # ------------------------------------------------------------ the owner thread

    def _run(self) -> None:
        next_scan = next_status = 0.0
        first = True
        while not self._stop.is_set():
            try:
                out: list[Command] = self.book.resume(self._now()) if first else []
                first = False
                try:
                    ev = self.events.get(timeout=0.2)
                    while True:
                        out += self._event(ev)
                        ev = self.events.get_nowait()
                except queue.Empty:
                    pass
                mono = time.monotonic()
                with self._lock:
                    asked = self._scan_asked
                if mono >= next_scan or asked > self._scanned:
                    out += self._scan(self._now())
                    next_scan = mono + 1.0
                    scanned = asked
                else:
                    scanned = self._scanned
                out += self.book.tick(self._now())
                self._execute(out)
                self._mark_fast()
                if self.book.dirty:
                    self._save()
                with self._lock:
                    self._scanned = scanned
                    self._busy = self.book.busy
                if mono >= next_status:
                    self._write_status()
                    next_status = mono + 2.0
            except Exception:
                self.failures += 1
                log.exception("site service loop")
                time.sleep(0.5)
        if self.book.dirty:
            self._save()

    def _awaited(self) -> str | None:
        return awaited_site(self.book)

    def _now(self) -> float:
        """The book's time: it stands still while the canary under check is cut off (``RolloutClock``)."""
        site = held_site(self.book)
        link = self.links.get(site) if site is not None else None
        return self.clock.now(time.monotonic(), link is not None and link.cut_since is not None)

    def _event(self, ev: Any) -> list[Command]:
        """A link's event into the book; a cut-short held-out batch is kept and run again once the site answers."""
        if isinstance(ev, ProbeCut):
            r = self.book.active
            if r is not None and (r.name, r.version) == (ev.name, ev.version) and r.step is Step.PROBE:
                self._cut_probes[ev.site] = Probe(ev.site, ev.name, ev.version,
                                                  tuple(sorted((r.baseline or {}).get("followers") or ())))
            return []
        out = self.book.handle(ev, self._now())
        if isinstance(ev, Seen) and ev.site in self._cut_probes:
            probe = self._cut_probes.pop(ev.site)
            r = self.book.active
            if r is not None and (r.name, r.version) == (probe.name, probe.version) and r.step is Step.PROBE:
                log.info("%s: site %s is back: running the held-out batch again", r.label, ev.site)
                out.append(probe)
        return out

    def _scan(self, now: float) -> list[Command]:
        """Releases the ServerApp (or ``fogline sites release``) put in the outbox since the last look."""
        out: list[Command] = []
        if not self.outbox.is_dir():
            return out
        for p in sorted(self.outbox.glob("*.release")):
            if p.name in self.book.seen or p.name in self._bad_files:
                continue
            try:
                rel = read_release(p)
            except ReleaseError as exc:
                self._bad_files.add(p.name)
                log.error("not rolling out %s: %s", p.name, exc)
                continue
            if ROLLBACK_KEY in rel.metadata:  # our own rollback releases are not rolled out again
                self.book.seen.add(p.name)
                self.book.dirty = True
                continue
            published = self._legacy is not None and p.name in self._legacy
            out += self.book.handle(NewRelease(rel.workload, rel.version, rel.sha256, p.name, published), now)
        return out

    def _execute(self, cmds: list[Command]) -> None:
        for c in cmds:
            if isinstance(c, Note):
                (log.warning if c.level == "warning" else log.info)("%s", c.text)
                self.notes.append((c.level, c.text))
            elif isinstance(c, Publish):
                try:
                    frame = self._frame(c.site, c.name, c.version)
                except ReleaseError as exc:
                    log.error("cannot publish %s v%d to %s: %s", c.name, c.version, c.site, exc)
                    continue
                self.links[c.site].submit(SendRelease(c.name, c.version, frame))
            elif isinstance(c, Probe):
                r = self.book.find(c.name, c.version)
                try:
                    blob = read_release(self.outbox / r.file).artifact if r is not None else b""
                except ReleaseError as exc:
                    log.error("cannot probe %s v%d: %s", c.name, c.version, exc)
                    blob = b""
                self.links[c.site].submit(RunProbe(c.name, c.version, c.workloads, blob, self.table.policy))
            elif isinstance(c, Restore):
                self._execute(self.book.handle(self._restore(c), self._now()))

    def _frame(self, site: str, name: str, version: int) -> bytes:
        """The outbox release signed by ``site``'s coordinator identity (cached while it is in use)."""
        key = (site, name, version)
        if key not in self._frames:
            if len(self._frames) > 8:
                self._frames.clear()
            rel = read_release(release_path(self.outbox, name, version))
            r = self.book.find(name, version)
            if r is not None and r.sha256 != rel.sha256:
                raise ReleaseError(f"{release_path(self.outbox, name, version).name} changed since it was queued")
            meta = {k: v for k, v in rel.metadata.items() if k not in _SIGNED_KEYS}
            signed = build_release(rel.artifact, self.table.get(site).creds.signing, name, version, meta)
            self._frames[key] = codec.encode(signed)
        return self._frames[key]

    def _restore(self, c: Restore) -> Restored | RestoreFailed:
        """The first candidate's bytes as a new version above everything in the outbox."""
        for v in c.candidates:
            try:
                old = read_release(release_path(self.outbox, c.name, v))
            except ReleaseError:
                continue
            as_version = max(c.version, *self._versions(c.name)) + 1
            meta = {k: v2 for k, v2 in old.metadata.items() if k not in _SIGNED_KEYS}
            meta.update({ROLLBACK_KEY: str(c.version), RESTORES_KEY: str(v)})
            rel = build_release(old.artifact, self.signer, c.name, as_version, meta)
            path = release_path(self.outbox, c.name, as_version)
            atomic_write(path, codec.encode(rel))
            self.book.seen.add(path.name)
            log.warning("wrote %s: v%d's model as v%d, undoing v%d", path.name, v, as_version, c.version)
            return Restored(c.name, c.version, as_version, v)
        return RestoreFailed(c.name, c.version, "no outbox file of v" + " or v".join(map(str, c.candidates)))

    def _versions(self, name: str) -> list[int]:
        out = [0]
        for p in self.outbox.glob(f"{name}-v*.release"):
            try:
                out.append(int(p.stem.rsplit("-v", 1)[1]))
            except (IndexError, ValueError):
                continue
        return out

    def _mark_fast(self) -> None:
        r = self.book.active
        awaited = self._awaited()
        want: set[str] = {awaited} if awaited is not None else set()
        for name, link in self.links.items():
            link.fast = name in want
            if name in want and r is not None and r.step is Step.BASELINE:
                link.poll_now.set()

    # ------------------------------------------------------------ files

    def _save(self) -> None:
        doc = self.book.to_json()
        atomic_write(self.work / ROLLOUTS_FILE, json.dumps(doc, indent=1))
        self.book.dirty = False
        self._write_published(doc)
        with self._lock:
            self._snapshot = doc

    def _write_published(self, doc: dict[str, Any]) -> None:
        pub: dict[str, dict[str, Any]] = {}
        for r in doc["rollouts"]:
            sites = sorted(s for s, st in r["sites"].items() if st["state"] == "accepted")
            if sites or r["reason"] == "published before staged rollouts":
                pub[r["file"]] = {"workload": r["name"], "version": r["version"], "sha256": r["sha256"],
                                  "sites": sites}
            rb = r.get("rollback")
            if rb and r["step"] == Step.ROLLED_BACK.value:
                f = release_path(self.outbox, r["name"], rb["as_version"]).name
                pub[f] = {"workload": r["name"], "version": rb["as_version"], "restores": rb["restores"],
                          "rollback_of": r["version"], "sites": [r["canary"]]}
        if pub or (self.outbox / PUBLISHED_FILE).exists():
            self.outbox.mkdir(parents=True, exist_ok=True)
            atomic_write(self.outbox / PUBLISHED_FILE, json.dumps(pub, indent=1, sort_keys=True))

    def _write_status(self, stopped: bool = False) -> None:
        active = self.book.active
        doc = {"at": time.time(), "pid": os.getpid(), "stopped": stopped, "canary": self.table.canary,
               "active": f"{active.label}: {active.step.value}" if active is not None else None,
               "sites": {s.name: {**self.links[s.name].info, "address": s.address, "identity": s.creds.name,
                                  "position": i, "canary": s.name == self.table.canary}
                         for i, s in enumerate(self.table.sites)}}
        path = self.work / STATUS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, json.dumps(doc, indent=1, default=str))

