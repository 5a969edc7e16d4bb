"""Process shell of ``fogline coordinator``: SuperLink, the staged Flower App, ``flwr run``, supervision.

Flower's Deployment Engine as its authors intend: a SuperLink (started here
unless one already listens at the address), SuperNodes started by the
devices, and ``flwr run`` of the user's Flower App, staged into the work
directory with the supervisor's settings. SuperNode authentication is on
unless ``insecure``: the SuperLink gets a TLS certificate from a small CA in
the work directory (SuperNodes trust ``superlink-tls/ca.pem``), runs with
``--enable-supernode-auth``, and every key of ``supernodes.json`` is
registered with ``flwr supernode register KEY --name DEVICE``. Devices reach
only its Fleet API (``cloud_coordinator.superlink``): the Control and Runtime
APIs, unauthenticated in Flower, listen on a loopback port of their own that
only this host's ``flwr`` commands and the SuperExec use.

Flower marks a run failed when the SuperLink or the ServerApp dies and never
resumes it; this shell restarts the SuperLink (if it owns it) and submits a
new run, which resumes from the newest verified checkpoint. A ServerApp that
stops on bad input writes ``fatal.json``: that is reported as one line and
not restarted. When to resubmit is ``supervision.step``'s decision, on what
Flower says about the run (``flwr ls``), never on the log stream ending: one
live run per checkpoint lineage.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime import children
from runtime.broker import free_port, port_open
from runtime.errors import FoglineError, LocalViolation

from .settings import FATAL_FILE, PROGRESS_FILE, REPORT_FILE, SETTINGS_ENV, SETTINGS_KEY
from .supernodes import SUPERNODES_FILE, KeyBook
from .supervision import (
    ACTIVE,
    Action,
    Component,
    Event,
    Health,
    Limits,
    RunPhase,
    State,
    diagnose,
    flower_event,
    step,
    watchdog_bound,
)

__all__ = ["SupervisorOptions", "Supervisor", "flower_bin", "flower_env", "require_loopback_superlink",
           "RunStopped", "TLS_DIR", "READY_FILE"]

log = logging.getLogger(__name__)
FLWR_HOME_DIR = ".flwr"
TLS_DIR = "superlink-tls"
READY_FILE = "superlink.json"  # written once the SuperLink listens and the authorized keys are registered
CONNECTION = "fogline"
QUERY_TIMEOUT_S = 60.0     # one flwr ls / stop (a CLI start and one Control API call; seconds on a busy host)
SUBMIT_TIMEOUT_S = 180.0   # flwr run: build the FAB, upload it, get a run id
LIVE_QUERY_S = 30.0        # while the log stream flows, ask Flower about the run this often (a safety net)
CHECK_QUERY_S = 3.0        # once the stream ended, this often until Flower says live or finished
SETTLE_S = 3.0             # a finished run's report.json may land just after Flower says finished
QUICK_S = 15.0             # a run refused or failed within this long of submit is a "quick" failure
_STARTED = re.compile(r"Successfully started run (\d+)")


def _app_name(app_dir: Path) -> str:
    import tomllib

    try:
        return str(tomllib.loads((app_dir / "pyproject.toml").read_text())["project"]["name"])
    except (OSError, ValueError, KeyError, TypeError):
        return ""


class RunStopped(FoglineError):
    """The ServerApp stopped the run on bad input (``fatal.json``): no restart helps."""


@dataclass(frozen=True, slots=True)
class SupervisorOptions:
    work_dir: Path
    app_dir: Path                      # the staged app
    settings_path: Path
    superlink: str = "127.0.0.1:9093"
    insecure: bool = False             # plain SuperLink, no SuperNode authentication (loopback only)
    max_restarts: int = 5
    timeout_s: float = 3600.0
    extra_env: Mapping[str, str] = field(default_factory=dict)
    watchdog_s: float | None = None    # no round progress for this long: diagnose and restart (None: off)
    max_stalls: int = 3                # watchdog restarts before stopping with its reason


def flower_bin(name: str) -> str:
    """A Flower executable next to this interpreter (venv), else on PATH."""
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def flower_env(home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update({"FLWR_HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
                "PYTHONUNBUFFERED": "1"})
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def superlink_tls(work_dir: Path, host: str) -> tuple[Path, Path, Path]:
    """(ca, certificate, key) of the SuperLink: a CA of its own under ``work_dir/superlink-tls``."""
    import ipaddress

    from runtime.pki import SiteCA

    d = work_dir / TLS_DIR
    ca = SiteCA.load_or_create(d, "superlink")
    try:
        ipaddress.ip_address(host)
        ips, names = {"127.0.0.1", host}, {"localhost"}
    except ValueError:
        ips, names = {"127.0.0.1"}, {"localhost", host}
    ca.ensure_server_cert(d, names, ips)
    return d / "ca.pem", d / "broker.pem", d / "broker.key"


class Supervisor:
    """Keeps one SuperLink (if owned) and one run alive until ``report.json`` says done."""

    def __init__(self, opts: SupervisorOptions, *, on_tick: Any = None) -> None:
        self.opts = opts
        self.dir = opts.work_dir
        self.home = self.dir / FLWR_HOME_DIR
        self.cwd = self.home / "cwd"  # where flwr commands run: nothing of the user's cwd leaks into them
        host, _, port = opts.superlink.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port)
        self.control = f"{self.host}:{self.port}"  # Control API: a loopback port of its own once we own the SuperLink
        self.superlink: subprocess.Popen[bytes] | None = None
        self.run_proc: subprocess.Popen[bytes] | None = None
        self.owned = False
        self.generation = 0
        self.restarts = 0
        # restarts per component (the superlink's include its own deaths); report.json and metrics show them
        self.component_restarts = {c.value: 0 for c in Component}
        self._progress_stamp: int | None = None
        self._progress_at = 0.0  # monotonic: the last sign of round progress (or the submit)
        self._watchdog_s = float(opts.watchdog_s or 0.0)  # raised when the ServerApp's deadline grows
        self._down_checked_at = -math.inf  # when the raised watchdog last asked whether a Flower part is down
        self._part_down = False
        self.on_tick = on_tick  # called every poll (the fog link publishes releases there)
        self.env = flower_env(self.home, {**opts.extra_env, SETTINGS_ENV: str(opts.settings_path)})
        self.app_name = _app_name(opts.app_dir)
        self._doc: dict[str, Any] | None = None
        self._submitted_at = self._next_query = self._settle_until = 0.0
        self._submitted_wall_ns = 0
        self._stalled_run: int | None = None
        self.fresh_db = False

    # -- SuperLink
    def _write_connection(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]",
                 f'address = "{self.control}"']
        if self.opts.insecure:
            lines.append("insecure = true")
        else:
            lines.append(f'root-certificates = "{self.dir / TLS_DIR / "ca.pem"}"')
        (self.home / "config.toml").write_text("\n".join(lines) + "\n")

    def ensure_superlink(self, timeout_s: float = 30.0) -> None:
        if self.superlink is not None and self.superlink.poll() is None:
            return
        if self.superlink is None and not self.owned and port_open(self.host, self.port):
            log.info("using the SuperLink already at %s:%d", self.host, self.port)
            self._write_connection()
            self._ready(self.register_supernodes())
            return
        self.generation += 1
        # The same database across restarts: SuperNodes keep their node ids and registrations.
        db = self.dir / "superlink.db"
        self.fresh_db = not db.exists()  # nothing registered, no stale runs: skip asking Flower
        # Devices get the Fleet API alone on HOST:PORT; Control and Runtime stay on a loopback port (-P: nothing
        # in the work directory shadows our modules).
        log_path = self.dir / "superlink.log"
        for attempt in range(3):  # a free port may be taken between free_port() and the bind: pick again
            control_port = free_port("127.0.0.1")
            while control_port == self.port:  # nothing listens on the Fleet port yet: it looks free too
                control_port = free_port("127.0.0.1")
            cmd = [sys.executable, "-P", "-m", "cloud_coordinator.superlink",
                   "--fleet-address", f"{self.host}:{self.port}",
                   "--database", str(db), "--host", "127.0.0.1", "--port", str(control_port),
                   "--disable-runtime-dependency-installation"]
            if self.opts.insecure:
                cmd.append("--insecure")
            else:
                ca, cert, key = superlink_tls(self.dir, self.host)
                cmd += ["--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                        "--enable-supernode-auth"]
            seen = log_path.stat().st_size if log_path.exists() else 0
            # cwd: what the ServerApp writes to its working directory (a final_model.pt) lands in the work dir
            # it watches us itself and takes Flower's SuperExec and ServerApps down with it (superlink.py)
            self.superlink = children.spawn(cmd, log=log_path, env=self.env, cwd=self.dir, die_with_parent=False)
            self.owned = True
            deadline = time.monotonic() + timeout_s
            while not (port_open(self.host, self.port) and port_open("127.0.0.1", control_port)):
                if self.superlink.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            else:
                break
            with open(log_path, "rb") as f:
                f.seek(seen)
                taken = f"{control_port}): address already in use" in f.read().decode(errors="replace")
            children.stop(self.superlink, 5.0)
            if not taken or attempt == 2:
                raise FoglineError(f"SuperLink did not start on {self.host}:{self.port} (see {log_path})")
            log.warning("the SuperLink's control port %d was taken before it could bind; trying another",
                        control_port)
        self.control = f"127.0.0.1:{control_port}"
        self._write_connection()
        self._ready(self.register_supernodes())

    def _ready(self, registered: list[str]) -> None:
        """Tell SuperNode launchers (devices, tests, the demo) where to connect and that keys are in."""
        doc = {"address": f"{self.host}:{self.port}", "generation": self.generation, "insecure": self.opts.insecure,
               "root_certificates": "" if self.opts.insecure else str(self.dir / TLS_DIR / "ca.pem"),
               "registered": registered, "at": time.time()}
        tmp = self.dir / f".{READY_FILE}.tmp"
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, self.dir / READY_FILE)

    def flwr(self, argv: list[str], timeout_s: float) -> tuple[int | None, str]:
        """One ``flwr`` CLI command on our connection: (exit code or None when it timed out and was killed, output).

        Its cwd is a directory of ours: ``flwr`` reads a ``pyproject.toml`` under a folder named like the
        connection ("fogline") in its cwd as a legacy configuration and fails.
        """
        self.cwd.mkdir(parents=True, exist_ok=True)
        p = children.spawn([flower_bin("flwr"), *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           env=self.env, cwd=self.cwd)
        try:
            out, _ = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
            return None, out.decode(errors="replace")
        return p.returncode, out.decode(errors="replace")

    def register_supernodes(self) -> list[str]:
        """Register the authorized keys Flower does not know yet (``registration``); all devices once done.

        A SuperNode whose key is not registered yet gives up after three tries, so devices
        should start once ``superlink.json`` lists them. A key that cannot be registered
        raises RegistrationFailed (one line, exit 2).
        """
        from .registration import (
            LEDGER_FILE,
            Budget,
            Outcome,
            classify,
            load_ledger,
            parse_listed,
            plan,
            register_all,
            save_ledger,
        )

        if self.opts.insecure:
            return []
        book = KeyBook(self.dir / SUPERNODES_FILE)
        if not book.nodes:
            log.warning("no SuperNode is authorized yet (fogline supernodes add DEVICE KEY.pub --checkpoint-dir %s)",
                        self.dir)
            return []
        budget = Budget()
        ledger_path = self.dir / LEDGER_FILE
        ledger = load_ledger(ledger_path)
        kids = {dev: node.key_id for dev, node in book.nodes.items()}
        if self.fresh_db or not ledger:  # a new database, or nothing registered by us yet: every key
            todo = sorted(kids)
        else:
            rc, out = self.flwr(["supernode", "list", CONNECTION, "--format", "json"], budget.try_s)
            todo = plan(kids, ledger, parse_listed(out) if rc == 0 else None)
        if todo:
            log.info("registering %d SuperNode key(s) with the SuperLink (at most %.0f s)", len(todo),
                     budget.total_s(len(todo)))
        with tempfile.TemporaryDirectory() as tmp:
            def run(dev: str, timeout_s: float) -> Outcome:
                pub = Path(tmp) / f"{dev}.pub"
                pub.write_text(book.nodes[dev].public_key + "\n")
                code, text = self.flwr(["supernode", "register", str(pub), CONNECTION, "--name", dev, "--format",
                                        "json"], timeout_s)
                return classify(code, text)

            got = register_all(todo, run, budget)
        for dev, node_id in got.items():
            log.info("registered SuperNode %s%s", dev, f" (node {node_id})" if node_id else " (already known)")
            ledger[kids[dev]] = node_id
        if got:
            save_ledger(ledger_path, ledger)
        return sorted(book.nodes)

    def superlink_dead(self) -> bool:
        if self.owned:
            return self.superlink is None or self.superlink.poll() is not None
        return not port_open(self.host, self.port)

    # -- runs
    def submit(self) -> None:
        self.cwd.mkdir(parents=True, exist_ok=True)
        overrides = self.dir / "run-config.toml"
        overrides.write_text(f'{SETTINGS_KEY} = {json.dumps(str(self.opts.settings_path))}\n')
        self.run_proc = children.spawn(
            [flower_bin("flwr"), "run", str(self.opts.app_dir), CONNECTION, "--stream", "--run-config",
             str(overrides)], log=self.dir / "flwr-run.log", env=self.env, cwd=self.cwd)

    def _json(self, name: str, since: float) -> dict[str, Any] | None:
        try:
            doc = json.loads((self.dir / name).read_text())
        except (OSError, ValueError):
            return None
        stamp = doc.get("finished_at", doc.get("at", 0))
        return doc if isinstance(doc, dict) and stamp >= since else None

    def _outcome(self, since: float) -> dict[str, Any] | None:
        if (fatal := self._json(FATAL_FILE, since)) is not None:
            raise RunStopped(str(fatal.get("error", "the run stopped")))
        doc = self._json(REPORT_FILE, since)
        return doc if doc is not None and doc.get("done") else None

    # -- what Flower says about our runs
    def _runs(self, run_id: int | None = None) -> list[dict[str, Any]] | None:
        """``flwr ls`` (one run or all) as dicts; None when Flower did not answer."""
        argv = ["ls", CONNECTION, "--format", "json"] + (["--run-id", str(run_id)] if run_id is not None else [])
        rc, out = self.flwr(argv, QUERY_TIMEOUT_S)
        try:
            doc = json.loads(out[out.index("{"):]) if rc == 0 else None
        except ValueError:
            doc = None
        if not isinstance(doc, dict) or doc.get("success") is not True or not isinstance(doc.get("runs"), list):
            return None
        return [r for r in doc["runs"] if isinstance(r, dict)]

    def run_status(self, run_id: int) -> str | None:
        runs = self._runs(run_id)
        return str(runs[0].get("status", "")) if runs else None

    def stop_stale(self) -> None:
        """Stop runs Flower still lists as live before submitting ours: one live run per lineage.

        On a SuperLink we own (its database is ours) every live run is a leftover whose ServerApp
        died with the previous SuperLink or coordinator; on someone else's, only runs of this app.
        """
        self.stop_stray_serverapps()
        if self.fresh_db:
            return
        for r in self._runs() or []:
            status = str(r.get("status", "")).split(":", 1)[0]
            if status in ACTIVE and (self.owned or r.get("fab-name") == self.app_name):
                rc, out = self.flwr(["stop", str(r.get("run-id")), CONNECTION], QUERY_TIMEOUT_S)
                log.warning("stopped stale run %s (%s)%s", r.get("run-id"), status,
                            "" if rc == 0 else f": {' '.join(out.split())[-200:]}")

    def _submit_and_wait(self, deadline: float) -> tuple[int | None, str]:
        """Submit; (the run id Flower gave, "") or (None, why flwr run gave up)."""
        logp = self.dir / "flwr-run.log"
        offset = logp.stat().st_size if logp.exists() else 0
        self.submit()
        assert self.run_proc is not None
        until = min(deadline, time.monotonic() + SUBMIT_TIMEOUT_S)
        while True:
            try:
                with open(logp, "rb") as f:
                    f.seek(offset)
                    text = f.read().decode(errors="replace")
            except OSError:
                text = ""
            if (m := _STARTED.search(text)) is not None:
                return int(m.group(1)), ""
            if self.run_proc.poll() is not None:
                return None, self._last_error_line()
            if time.monotonic() > until:
                self._stop_run()
                return None, f"flwr run did not start a run within {SUBMIT_TIMEOUT_S:.0f} s"
            if self.on_tick is not None:
                self.on_tick()
            time.sleep(0.2)

    def _follow(self, run_id: int) -> None:
        """Follow a live run's logs again after its stream ended (the run itself goes on)."""
        self._stop_run()
        self.run_proc = children.spawn([flower_bin("flwr"), "log", str(run_id), CONNECTION, "--stream"],
                                       log=self.dir / "flwr-run.log", env=self.env, cwd=self.cwd)

    def _observe(self, state: State, started: float, deadline: float) -> list[tuple[Event, dict[str, Any]]]:
        """What happened since the last poll, as events for ``supervision.step`` (at most one)."""
        if self.on_tick is not None:
            self.on_tick()
        try:
            if (doc := self._outcome(started)) is not None:
                self._doc = doc
                return [(Event.REPORT_DONE, {})]
        except RunStopped as exc:
            return [(Event.FATAL, {"reason": str(exc)})]
        now = time.monotonic()
        if now > deadline:
            return [(Event.TIMEOUT, {"reason": f"coordinator timed out after {self.opts.timeout_s:.0f} s"})]
        if state.phase is not RunPhase.IDLE and self.superlink_dead():
            log.warning("SuperLink died mid-run; restarting it and resuming from checkpoint")
            self.component_restarts[Component.SUPERLINK] += 1
            return [(Event.SUPERLINK_DEAD, {})]
        if self.opts.watchdog_s and state.phase in (RunPhase.LIVE, RunPhase.CHECKING):
            self._note_progress()
            silent = now - self._progress_at
            # the bound raised for a long adapted deadline covers a ServerApp at work; with a Flower
            # part known down nothing works meanwhile, so the configured watchdog holds
            limit = self._watchdog_s
            if silent > float(self.opts.watchdog_s) and limit > float(self.opts.watchdog_s):
                if now - self._down_checked_at >= 10.0:  # flwr ls: not every tick
                    self._down_checked_at = now
                    h = self.health(state)
                    self._part_down = h.superexec is False or not h.superlink
                if self._part_down:
                    limit = float(self.opts.watchdog_s)
            if silent > limit:
                component, line = diagnose(silent, limit, self.health(state))
                log.warning("%s; restarting the %s", line, component)
                self._progress_at = now
                return [(Event.STALLED, {"component": component, "reason": line, "restartable": self.owned})]
        if state.phase is RunPhase.SETTLING:
            return [(Event.SETTLED, {})] if now >= self._settle_until else []
        stream_ended = self.run_proc is None or self.run_proc.poll() is not None
        if state.phase is RunPhase.LIVE and stream_ended:
            return [(Event.STREAM_ENDED, {})]
        if state.phase in (RunPhase.LIVE, RunPhase.CHECKING) and now >= self._next_query and state.run_id is not None:
            status = self.run_status(state.run_id)
            ev = flower_event(status)
            self._next_query = now + (LIVE_QUERY_S if ev is Event.ACTIVE else CHECK_QUERY_S)
            if ev is Event.FINISHED:
                self._settle_until = now + SETTLE_S
                quick = now - self._submitted_at < QUICK_S and status != "finished:completed"
                log.warning("run %s %s without finishing the rounds", state.run_id, status)
                return [(ev, {"quick": quick, "reason": f"run {state.run_id} {status}: {self._last_error_line()}"})]
            if ev is Event.ACTIVE and state.phase is RunPhase.CHECKING:
                log.info("the log stream of run %s ended but Flower says it is %s; not resubmitting",
                         state.run_id, status)
            return [(ev, {})]
        return []

    # -- the watchdog's eyes
    def _note_progress(self) -> None:
        try:
            stamp = (self.dir / PROGRESS_FILE).stat().st_mtime_ns
        except OSError:
            return
        if stamp != self._progress_stamp:
            if self._progress_stamp is not None or stamp >= self._submitted_wall_ns:
                self._progress_at = time.monotonic()
            self._progress_stamp = stamp
            try:  # an adapted deadline longer than the watchdog assumed: a working attempt may be silent longer
                doc = json.loads((self.dir / PROGRESS_FILE).read_text())
                bound = watchdog_bound(float(doc.get("deadline_s", 0.0)), float(doc.get("grace_s", 0.0)))
            except (OSError, ValueError, AttributeError, TypeError):
                return
            self._watchdog_s = max(float(self.opts.watchdog_s or 0.0), bound)

    def _flower_children(self) -> tuple[bool | None, bool | None]:
        """(SuperExec alive, a ServerApp alive) under our SuperLink; (None, None) when not ours to see."""
        if not self.owned or self.superlink is None or self.superlink.poll() is not None:
            return None, None
        import psutil

        superexec = serverapp = False
        try:
            procs = psutil.Process(self.superlink.pid).children(recursive=True)
        except psutil.Error:
            return None, None
        for p in procs:
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            superexec = superexec or "flower-superexec" in cmd
            serverapp = serverapp or "flwr-serverapp" in cmd
        return superexec, serverapp

    def health(self, state: State) -> Health:
        """What is up and what the ServerApp last said it waits for (for the watchdog's one line)."""
        up = not self.superlink_dead()
        superexec, serverapp = self._flower_children() if up else (None, None)
        status = self.run_status(state.run_id) if up and state.run_id is not None else None
        try:
            doc = json.loads((self.dir / PROGRESS_FILE).read_text())
            fresh = float(doc.get("at", 0)) * 1e9 >= self._submitted_wall_ns  # this run's, not an earlier one's
            waiting = str(doc.get("waiting", "")) if fresh else ""
        except (OSError, ValueError, AttributeError, TypeError):
            waiting = ""
        return Health(up, superexec, serverapp, state.run_id, status, waiting)

    def _restart_superlink(self) -> None:
        if self.owned and self.superlink is not None:
            children.stop(self.superlink, 10.0)
        self.stop_stray_serverapps()

    def stop_stray_serverapps(self, *, quiet: bool = False) -> int:
        """Kill ServerApps of this work directory (their cwd: our SuperLink starts them there) that are not ours
        any more: a ServerApp outlives a killed SuperExec, and then even the coordinator (kill -9 included),
        keeping the work directory's lock. Only when the SuperLink is ours; returns how many."""
        if not self.owned:
            return 0
        import psutil

        found = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if "flwr-serverapp" in " ".join(p.info["cmdline"] or ()) and Path(p.cwd()) == self.dir:
                    p.kill()
                    found.append(p)
            except psutil.Error:
                continue
        psutil.wait_procs(found, timeout=10)
        if found:
            (log.info if quiet else log.warning)("stopped %d ServerApp(s) left running in %s", len(found), self.dir)
        return len(found)

    def _do(self, action: Action, state: State, deadline: float) -> list[tuple[Event, dict[str, Any]]]:
        if action is Action.STOP_RUN:
            if self._stalled_run is not None and not self.superlink_dead():
                rc, out = self.flwr(["stop", str(self._stalled_run), CONNECTION], QUERY_TIMEOUT_S)
                if rc != 0 and "already finished" not in out:
                    log.warning("could not stop run %s: %s", self._stalled_run, " ".join(out.split())[-200:])
            self._stop_run()
            self.stop_stray_serverapps()
        elif action is Action.RESTART_SUPERLINK:
            self._restart_superlink()
        elif action is Action.ENSURE_SUPERLINK:
            self.ensure_superlink()
        elif action is Action.STOP_STALE:
            self.stop_stale()
        elif action is Action.SUBMIT:
            if state.restarts:
                time.sleep(1.0)
            self._submitted_at = self._progress_at = time.monotonic()
            self._submitted_wall_ns = time.time_ns()
            self._progress_stamp = None
            run_id, why = self._submit_and_wait(deadline)
            self._next_query = time.monotonic() + LIVE_QUERY_S
            if run_id is not None:
                log.info("submitted run %d", run_id)
                return [(Event.SUBMITTED, {"run_id": run_id})]
            log.warning("flwr run did not start a run: %s", why)
            return [(Event.SUBMIT_FAILED, {"quick": time.monotonic() - self._submitted_at < QUICK_S, "reason": why})]
        elif action is Action.QUERY:
            self._next_query = 0.0
        elif action is Action.FOLLOW and state.run_id is not None:
            self._follow(state.run_id)
        return []

    def run(self) -> dict[str, Any]:
        """Until done: (re)start the SuperLink and the run, as ``supervision.step`` says; bounded restarts and time."""
        started = time.time()
        deadline = time.monotonic() + self.opts.timeout_s
        limits = Limits(max_restarts=self.opts.max_restarts, max_stalls=self.opts.max_stalls)
        state = State()
        queue: deque[tuple[Event, dict[str, Any]]] = deque([(Event.START, {})])
        try:
            while True:
                while queue:
                    event, kw = queue.popleft()
                    before = state
                    self._stalled_run = state.run_id
                    state, actions = step(state, event, limits, **kw)
                    self.restarts = state.restarts
                    if event is Event.STALLED and state.phase is not RunPhase.FAILED:
                        self.component_restarts[kw["component"]] += 1
                    if state.phase is RunPhase.DONE:
                        assert self._doc is not None
                        return self._with_restarts(self._doc)
                    if state.phase is RunPhase.FAILED:
                        if event is Event.FATAL:
                            raise RunStopped(state.reason or "the run stopped")
                        where = "" if event is Event.TIMEOUT else f"; see {self.dir / 'flwr-run.log'}"
                        raise FoglineError(f"{state.reason}{where}")
                    if before.phase is not state.phase:
                        log.debug("supervision: %s --%s--> %s", before.phase, event, state.phase)
                    if state.phase is RunPhase.IDLE and Action.SUBMIT in actions:
                        self._stop_run()
                    for action in actions:
                        queue.extend(self._do(action, state, deadline))
                queue.extend(self._observe(state, started, deadline))
                if not queue:
                    time.sleep(0.5)
        finally:
            self.close()

    def _with_restarts(self, doc: dict[str, Any]) -> dict[str, Any]:
        """report.json gets the supervisor's own counts: run restarts and restarts per component."""
        from runtime.files import atomic_write

        doc = {**doc, "supervisor": {"restarts": self.restarts, "components": dict(self.component_restarts)}}
        try:
            atomic_write(self.dir / REPORT_FILE, json.dumps(doc, indent=1, default=float).encode())
        except OSError as exc:
            log.warning("cannot add the restarts to %s: %s", REPORT_FILE, exc)
        return doc

    def _last_error_line(self) -> str:
        try:
            lines = (self.dir / "flwr-run.log").read_text(errors="replace").splitlines()
        except OSError:
            return "no log"
        for line in reversed(lines):
            text = " ".join(line.replace("\x1b", "").split())
            if text and any(w in text.lower() for w in ("error", "invalid", "exception", "not found")):
                return text[-300:]
        return f"see {self.dir / 'flwr-run.log'}"

    def _stop_run(self) -> None:
        if self.run_proc is not None and self.run_proc.poll() is None:
            self.run_proc.kill()
            self.run_proc.wait(10)
        self.run_proc = None

    def close(self) -> None:
        self._stop_run()
        if self.owned:
            children.stop(self.superlink, 10.0)
        self.stop_stray_serverapps(quiet=True)  # one still exiting after its last round, or an orphan


def require_loopback_superlink(host: str) -> None:
    """``--insecure`` (no TLS, no SuperNode authentication) only where nobody else can connect."""
    from runtime.net import is_loopback

    if not is_loopback(host):
        raise LocalViolation(f"--no-supernode-auth is refused for SuperLink address {host}: without TLS and SuperNode "
                             "authentication anyone who reaches it joins the federation; loopback only")
    log.warning("INSECURE: SuperLink %s without TLS or SuperNode authentication (one machine only)", host)
