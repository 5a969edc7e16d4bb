"""Process shell of ``fogline coordinator``: SuperLink, Flower App, ``flwr run``, supervision.

Flower's Deployment Engine as its authors intend: a SuperLink (started here
unless one already listens at the address), SuperNodes started by the
devices, and ``flwr run`` of a local Flower App whose ServerApp is
``cloud_coordinator.flower_server:app``. The App directory and the Flower
config (``FLWR_HOME``) are generated into the checkpoint directory, so an
installed package works offline. Flower marks a run failed when the SuperLink
dies and never resumes it; this shell restarts the SuperLink (if it owns it)
and submits a new run, which resumes from the newest verified checkpoint.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.broker import free_port, port_open
from runtime.errors import FoglineError

from .store import REPORT_FILE

__all__ = ["CoordinatorOptions", "Supervisor", "flower_env", "write_app"]

log = logging.getLogger(__name__)
APP_DIR = ".flower_app"
FLWR_HOME_DIR = ".flwr"
CONNECTION = "fogline"


@dataclass(frozen=True, slots=True)
class CoordinatorOptions:
    checkpoint_dir: Path
    run_config: Mapping[str, Any]
    superlink: str = "127.0.0.1:9093"
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


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


def write_app(app_dir: Path, run_config: Mapping[str, Any]) -> Path:
    """The Flower App: only a pyproject naming our installed ServerApp/ClientApp and the run config."""
    app_dir.mkdir(parents=True, exist_ok=True)
    lines = [
        "[build-system]", 'requires = ["hatchling"]', 'build-backend = "hatchling.build"', "",
        "[project]", 'name = "fogline-coordinator"', 'version = "1.0.0"',
        'description = "Fogline federated training (generated; edit the fogline CLI flags instead)"',
        'license = "Apache-2.0"', "dependencies = []", "",
        "[tool.flwr.app]", 'publisher = "fogline"', "",
        "[tool.flwr.app.components]", 'serverapp = "cloud_coordinator.flower_server:app"',
        'clientapp = "edge_agent.flower_client:app"', "",
        "[tool.flwr.app.config]",
    ]
    lines += [f"{k} = {_toml_value(v)}" for k, v in sorted(run_config.items())]
    path = app_dir / "pyproject.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def write_flower_config(home: Path, address: str) -> None:
    home.mkdir(parents=True, exist_ok=True)
    (home / "config.toml").write_text(
        f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
        f'address = "{address}"\ninsecure = true\n')


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the SuperLink gets SIGKILL when the coordinator dies, even by kill -9."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Supervisor:
    """Keeps one SuperLink (if owned) and one run alive until ``report.json`` says done."""

    def __init__(self, opts: CoordinatorOptions) -> None:
        self.opts = opts
        self.dir = opts.checkpoint_dir
        self.home = self.dir / FLWR_HOME_DIR
        host, _, port = opts.superlink.rpartition(":")
        self.host, self.port = host or "127.0.0.1", int(port)
        self.superlink: subprocess.Popen[bytes] | None = None
        self.run_proc: subprocess.Popen[bytes] | None = None
        self.owned = False
        self.generation = 0
        self.restarts = 0
        self.env = flower_env(self.home, opts.extra_env)

    # -- SuperLink
    def ensure_superlink(self, timeout_s: float = 30.0) -> None:
        if self.superlink is not None and self.superlink.poll() is None:
            return
        if self.superlink is None and not self.owned and port_open(self.host, self.port):
            log.info("using the SuperLink already at %s:%d", self.host, self.port)
            return
        self.generation += 1
        # The same database across restarts: SuperNodes keep their node ids (a fresh
        # database answers their heartbeats with 401 and they shut down).
        db = self.dir / "superlink.db"
        logf = open(self.dir / "superlink.log", "ab")  # noqa: SIM115 - owned by the child
        self.superlink = subprocess.Popen(
            [_bin("flower-superlink"), "--insecure", "--database", str(db), "--host", self.host,
             "--port", str(self.port), "--disable-runtime-dependency-installation"],
            stdout=logf, stderr=subprocess.STDOUT, env=self.env, preexec_fn=_die_with_parent)
        logf.close()
        self.owned = True
        deadline = time.monotonic() + timeout_s
        while not port_open(self.host, self.port):
            if self.superlink.poll() is not None or time.monotonic() > deadline:
                raise FoglineError(f"SuperLink did not start on {self.host}:{self.port} "
                                   f"(see {self.dir / 'superlink.log'})")
            time.sleep(0.2)

    def superlink_dead(self) -> bool:
        if self.owned:
            return self.superlink is None or self.superlink.poll() is not None
        return not port_open(self.host, self.port)

    # -- runs
    def submit(self) -> None:
        app = self.dir / APP_DIR
        write_app(app, self.opts.run_config)
        write_flower_config(self.home, f"{self.host}:{self.port}")
        logf = open(self.dir / "flwr-run.log", "ab")  # noqa: SIM115 - owned by the child
        self.run_proc = subprocess.Popen([_bin("flwr"), "run", str(app), CONNECTION, "--stream"],
                                         stdout=logf, stderr=subprocess.STDOUT, env=self.env,
                                         preexec_fn=_die_with_parent)
        logf.close()

    def report(self, since: float) -> dict[str, Any] | None:
        try:
            doc = json.loads((self.dir / REPORT_FILE).read_text())
        except (OSError, ValueError):
            return None
        if doc.get("finished_at", 0) < since or doc.get("rounds_done") != self.opts.run_config["rounds"]:
            return None
        return doc  # type: ignore[no-any-return]

    def run(self) -> dict[str, Any]:
        """Until done: (re)start the SuperLink and the run; bounded restarts and total time."""
        started = time.time()
        deadline = time.monotonic() + self.opts.timeout_s
        try:
            while True:
                self.ensure_superlink()
                self.submit()
                assert self.run_proc is not None
                while True:
                    if (doc := self.report(started)) is not None:
                        return doc
                    if time.monotonic() > deadline:
                        raise FoglineError(f"coordinator timed out after {self.opts.timeout_s:.0f} s")
                    if self.superlink_dead():
                        log.warning("SuperLink died mid-run; restarting it and resuming from checkpoint")
                        break
                    if self.run_proc.poll() is not None:
                        time.sleep(1.0)  # the report may land just after the stream closes
                        if (doc := self.report(started)) is not None:
                            return doc
                        log.warning("run ended without finishing (exit %s); resubmitting",
                                    self.run_proc.returncode)
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
