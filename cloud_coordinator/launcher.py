"""Process shell of ``fogline coordinator``: SuperLink, the staged Flower App, ``flwr run``, supervision.

Flower's Deployment Engine as its authors intend: a SuperLink (started here
unless one already listens at the address), SuperNodes started by the
devices, and ``flwr run`` of the user's Flower App, staged into the work
directory with the supervisor's settings. SuperNode authentication is on
unless ``insecure``: the SuperLink gets a TLS certificate from a small CA in
the work directory (SuperNodes trust ``superlink-tls/ca.pem``), runs with
``--enable-supernode-auth``, and every key of ``supernodes.json`` is
registered with ``flwr supernode register KEY --name DEVICE``.

Flower marks a run failed when the SuperLink or the ServerApp dies and never
resumes it; this shell restarts the SuperLink (if it owns it) and submits a
new run, which resumes from the newest verified checkpoint. A ServerApp that
stops on bad input writes ``fatal.json``: that is reported as one line and
not restarted.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.broker import port_open
from runtime.errors import FoglineError, LocalViolation

from .settings import FATAL_FILE, REPORT_FILE, SETTINGS_ENV, SETTINGS_KEY
from .supernodes import SUPERNODES_FILE, KeyBook

__all__ = ["SupervisorOptions", "Supervisor", "flower_env", "RunStopped", "TLS_DIR", "READY_FILE"]

log = logging.getLogger(__name__)
FLWR_HOME_DIR = ".flwr"
TLS_DIR = "superlink-tls"
READY_FILE = "superlink.json"  # written once the SuperLink listens and the authorized keys are registered
CONNECTION = "fogline"


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


def _bin(name: str) -> str:
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


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGKILL when the coordinator dies, even by kill -9."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


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
        host, _, port = opts.superlink.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port)
        self.superlink: subprocess.Popen[bytes] | None = None
        self.run_proc: subprocess.Popen[bytes] | None = None
        self.owned = False
        self.generation = 0
        self.restarts = 0
        self.on_tick = on_tick  # called every poll (the fog link publishes releases there)
        self.env = flower_env(self.home, {**opts.extra_env, SETTINGS_ENV: str(opts.settings_path)})

    # -- SuperLink
    def _write_connection(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        lines = ["[superlink]", f'default = "{CONNECTION}"', "", f"[superlink.{CONNECTION}]",
                 f'address = "{self.host}:{self.port}"']
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
        cmd = [_bin("flower-superlink"), "--database", str(db), "--host", self.host, "--port", str(self.port),
               "--disable-runtime-dependency-installation"]
        if self.opts.insecure:
            cmd.append("--insecure")
        else:
            ca, cert, key = superlink_tls(self.dir, self.host)
            cmd += ["--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                    "--enable-supernode-auth"]
        logf = open(self.dir / "superlink.log", "ab")  # noqa: SIM115 - owned by the child
        # cwd: what the ServerApp writes to its working directory (a final_model.pt) lands in the work dir
        self.superlink = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=self.env, cwd=self.dir,
                                          preexec_fn=_die_with_parent)
        logf.close()
        self.owned = True
        deadline = time.monotonic() + timeout_s
        while not port_open(self.host, self.port):
            if self.superlink.poll() is not None or time.monotonic() > deadline:
                raise FoglineError(f"SuperLink did not start on {self.host}:{self.port} "
                                   f"(see {self.dir / 'superlink.log'})")
            time.sleep(0.2)
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

    def register_supernodes(self) -> list[str]:
        """Register every authorized key with the SuperLink (Flower's Control API); known ones are skipped.

        A SuperNode whose key is not registered yet gives up after three tries, so devices
        should start once ``superlink.json`` lists them.
        """
        if self.opts.insecure:
            return []
        book = KeyBook(self.dir / SUPERNODES_FILE)
        if not book.nodes:
            log.warning("no SuperNode is authorized yet (fogline supernodes add DEVICE KEY.pub --checkpoint-dir %s)",
                        self.dir)
            return []
        procs = []
        done: list[str] = []
        with tempfile.TemporaryDirectory() as tmp:
            for dev, node in sorted(book.nodes.items()):
                pub = Path(tmp) / f"{dev}.pub"
                pub.write_text(node.public_key + "\n")
                procs.append((dev, subprocess.Popen(
                    [_bin("flwr"), "supernode", "register", str(pub), CONNECTION, "--name", dev],
                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.env)))
            for dev, p in procs:
                out, _ = p.communicate(timeout=60)
                text = out.decode(errors="replace")
                if p.returncode == 0:
                    log.info("registered SuperNode %s", dev)
                    done.append(dev)
                elif "already" in text.lower() or "in use" in text.lower():
                    log.debug("SuperNode %s already registered", dev)
                    done.append(dev)
                else:
                    log.warning("registering SuperNode %s failed: %s", dev, " ".join(text.split())[-300:])
        return done

    def superlink_dead(self) -> bool:
        if self.owned:
            return self.superlink is None or self.superlink.poll() is not None
        return not port_open(self.host, self.port)

    # -- runs
    def submit(self) -> None:
        overrides = self.dir / "run-config.toml"
        overrides.write_text(f'{SETTINGS_KEY} = {json.dumps(str(self.opts.settings_path))}\n')
        logf = open(self.dir / "flwr-run.log", "ab")  # noqa: SIM115 - owned by the child
        self.run_proc = subprocess.Popen(
            [_bin("flwr"), "run", str(self.opts.app_dir), CONNECTION, "--stream", "--run-config", str(overrides)],
            stdout=logf, stderr=subprocess.STDOUT, env=self.env, cwd=self.dir, preexec_fn=_die_with_parent)
        logf.close()

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

    def run(self) -> dict[str, Any]:
        """Until done: (re)start the SuperLink and the run; bounded restarts and total time."""
        started = time.time()
        deadline = time.monotonic() + self.opts.timeout_s
        quick = 0  # consecutive runs that failed within seconds: flwr refused the app, retrying will not help
        try:
            while True:
                self.ensure_superlink()
                t_submit = time.monotonic()
                self.submit()
                assert self.run_proc is not None
                while True:
                    if self.on_tick is not None:
                        self.on_tick()
                    if (doc := self._outcome(started)) is not None:
                        return doc
                    if time.monotonic() > deadline:
                        raise FoglineError(f"coordinator timed out after {self.opts.timeout_s:.0f} s")
                    if self.superlink_dead():
                        log.warning("SuperLink died mid-run; restarting it and resuming from checkpoint")
                        break
                    if self.run_proc.poll() is not None:
                        for _ in range(10):  # the report may land just after the stream closes
                            if (doc := self._outcome(started)) is not None:
                                return doc
                            time.sleep(0.3)
                        log.warning("run ended without finishing (exit %s); resubmitting", self.run_proc.returncode)
                        quick = quick + 1 if time.monotonic() - t_submit < 15 and self.run_proc.returncode else 0
                        if quick >= 2:
                            raise FoglineError(f"flwr run keeps failing: {self._last_error_line()}")
                        break
                    time.sleep(0.5)
                self._stop_run()
                self.restarts += 1
                if self.restarts > self.opts.max_restarts:
                    raise FoglineError(f"gave up after {self.opts.max_restarts} restarts; see "
                                       f"{self.dir / 'flwr-run.log'}")
                time.sleep(1.0)
        finally:
            self.close()

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
        if self.owned and self.superlink is not None and self.superlink.poll() is None:
            self.superlink.terminate()
            try:
                self.superlink.wait(10)
            except subprocess.TimeoutExpired:
                self.superlink.kill()
                self.superlink.wait(10)


def require_loopback_superlink(host: str) -> None:
    """``--insecure`` (no TLS, no SuperNode authentication) only where nobody else can connect."""
    from runtime.net import is_loopback

    if not is_loopback(host):
        raise LocalViolation(f"--no-supernode-auth is refused for SuperLink address {host}: without TLS and SuperNode "
                             "authentication anyone who reaches it joins the federation; loopback only")
    log.warning("INSECURE: SuperLink %s without TLS or SuperNode authentication (one machine only)", host)
