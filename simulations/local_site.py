"""A fog broker on this machine, started the way the README says, and an operator's hands on it.

The demo, the benchmarks and the integration tests all need the same few
things: ``fogline broker`` as a real process (secure by default: its own CA,
mosquitto with TLS and an ACL), its "ready" line, bootstrap tokens for the
agents they start, and operator credentials. Tokens and credentials are made
through the fog's data dir (``fog_broker.site``), exactly as ``fogline token
create`` and ``fogline operators add`` do on the fog host.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from runtime import children
from runtime.broker import free_port
from runtime.errors import LocalViolation

__all__ = ["LocalSite"]


class LocalSite:
    """``fogline broker`` as a child process in its own session; ``start()`` waits for its ready line."""

    def __init__(self, data_dir: str | Path, *, site: str = "default", port: int | None = None,
                 host: str = "127.0.0.1", insecure: bool = False, args: Sequence[str] = (),
                 env: dict[str, str] | None = None, log: str | Path | None = None, verbose: int = 1,
                 zeroconf: bool = False) -> None:
        self.zeroconf = zeroconf
        self.data_dir = Path(data_dir)
        self.site = site
        self.port = port or free_port()
        self.host = host
        self.insecure = insecure
        self.args = list(args)
        self.env = env
        self.log = Path(log) if log is not None else self.data_dir.parent / f"{self.data_dir.name}.log"
        self.verbose = verbose
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}

    # ------------------------------------------------------------ the process

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "runtime.cli"] + ["-v"] * self.verbose + [
            "broker", "--data-dir", str(self.data_dir), "--site", self.site, "--port", str(self.port),
            "--host", self.host] + ([] if self.zeroconf else ["--no-zeroconf"])
        return argv + (["--insecure"] if self.insecure else []) + self.args

    def start(self, timeout: float = 60.0) -> LocalSite:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as err:
            self.proc = children.spawn(self.argv(), stdout=subprocess.PIPE, stderr=err, env=self.env)
        lines: queue.Queue[bytes] = queue.Queue()
        out = self.proc.stdout
        assert out is not None

        def pump() -> None:
            for line in out:
                lines.put(line)
            lines.put(b"")

        threading.Thread(target=pump, name="fog-stdout", daemon=True).start()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = lines.get(timeout=max(0.05, deadline - time.monotonic()))
            except queue.Empty:
                line = None
            if line:
                try:
                    msg = json.loads(line)
                except ValueError:
                    continue
                if isinstance(msg, dict) and msg.get("event") == "ready":
                    self.ready = msg
                    return self
                continue
            if line == b"" or time.monotonic() >= deadline:
                tail = self.log.read_text(errors="replace")[-600:] if self.log.exists() else ""
                self.kill()
                raise LocalViolation(f"fog broker did not become ready within {timeout:g} s; log tail: {tail}")

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _mosquitto_pid(self) -> int | None:
        try:
            return int(json.loads((self.data_dir / "mqtt" / "owner.json").read_text())["pid"])
        except (OSError, ValueError, KeyError):
            return None

    def kill_fog_only(self) -> None:
        """kill -9 of the fog broker process alone (a fog crash): its mosquitto dies with it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def kill(self) -> None:
        """kill -9 of the fog broker and of its mosquitto."""
        pid = self._mosquitto_pid()
        self.kill_fog_only()
        _sigkill(pid)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (the broker stops its mosquitto), then make sure nothing is left."""
        pid = self._mosquitto_pid()
        children.stop(self.proc, timeout)
        self.kill()
        _sigkill(pid)

    def __enter__(self) -> LocalSite:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------ addresses and identities

    @property
    def mqtt(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def enroll(self) -> str:
        return str(self.ready.get("enroll", f"127.0.0.1:{self.port + 1}"))

    def credentials(self, name: str = "admin") -> Path:
        return self.data_dir / "credentials" / name

    def _site(self) -> Any:
        from fog_broker.site import Site
        return Site(self.data_dir)

    def token(self, uses: int = 1, *, ttl_s: float = 3600.0, auto_approve: bool = True) -> str:
        site = self._site()
        try:
            return str(site.create_token(time.time(), ttl_s=ttl_s, uses=uses, auto_approve=auto_approve))
        finally:
            site.close()

    def issue(self, name: str, role: str = "operator") -> Path:
        """``fogline operators add NAME --role ROLE``: a credentials directory for another identity."""
        site = self._site()
        try:
            return Path(site.issue_credentials(name, role, None, time.time()))
        finally:
            site.close()

    def operators_add(self, name: str, role: str = "operator", out: str | Path | None = None,
                      timeout: float = 60.0) -> Path:
        """``fogline operators add NAME --role ROLE --data-dir FOGDIR [--out DIR]``, run as the command an
        operator types on the fog host; the credentials directory it wrote."""
        argv = [sys.executable, "-m", "runtime.cli", "operators", "add", name, "--role", role,
                "--data-dir", str(self.data_dir)] + (["--out", str(out)] if out is not None else [])
        r = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout, check=False,
                           stdin=subprocess.DEVNULL)
        if r.returncode != 0:
            raise LocalViolation(f"fogline operators add {name} --role {role} failed ({r.returncode}): "
                                 f"{(r.stderr or r.stdout).strip()[-600:]}")
        return Path(out) if out is not None else self.credentials(name)

    def add_device_key(self, device_id: str, key: bytes) -> None:
        """``fogline devices add ID --key HEX`` (the --insecure path)."""
        site = self._site()
        try:
            site.add_device(device_id, key, time.time())
        finally:
            site.close()

    def client(self, name: str = "admin", **kw: Any) -> Any:
        from fog_broker.client import FogClient
        return FogClient("127.0.0.1", self.port, credentials=self.credentials(name), insecure=self.insecure, **kw)

    def spawn_agents(self, agents: list[dict[str, Any]], directory: str | Path, log: str | Path,
                     interval: float = 1.0, *, host: str | None = None,
                     wrap: Sequence[str] = (), port: int | None = None) -> subprocess.Popen[bytes]:
        """One process of simulated agents with custom profiles (``simulations.agent_group``), enrolled
        with a fresh token; in its own session, so ``os.killpg`` is a kill -9 of the whole group.
        ``wrap`` prefixes the command (``ip netns exec NS``: a shaped link, ``simulations.netshape``)
        and ``host`` is the fog's address from there; ``port`` the MQTT port they reach it at (a
        ``simulations.wan_relay.WanLink`` in between; enrolment still goes direct)."""
        spec = {"agents": agents, "dir": str(directory), "port": port or self.port, "enroll": self.enroll,
                "token": self.token(uses=len(agents)), "interval": interval}
        if host is not None:
            spec["host"] = host
        env = dict(self.env or os.environ)
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
        with open(log, "ab") as err:
            return children.spawn([*wrap, sys.executable, "-m", "simulations.agent_group", json.dumps(spec)],
                                  env=env, stdout=subprocess.DEVNULL, stderr=err)

    def agent_argv(self, device_id: str, data_dir: str | Path, *extra: str, token: str | None = None) -> list[str]:
        """``python -m edge_agent`` enrolling with a token on first start (unless already enrolled)."""
        argv = [sys.executable, "-m", "edge_agent", "--broker", self.mqtt, "--id", device_id,
                "--data-dir", str(data_dir), "--enroll", self.enroll]
        return argv + ["--token", token or self.token()] + list(extra)


def _sigkill(pid: int | None) -> None:
    """kill -9 of ``pid`` when there is one; already gone (or never ours) is what we wanted."""
    if pid is not None:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
