"""Test side of the coordinator's fog contract: a credentials directory and a fog that seals summaries.

Until the fog issues coordinator credentials over TLS, tests make the same
directory layout (``runtime.credentials``) themselves and talk plain MQTT to a
loopback mosquitto with ``--insecure``; the fog's summaries are sealed by a
test fog identity (``edge_agent.testing.FogSigner``).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

from edge_agent.testing import FogSigner
from runtime.credentials import Credentials, FogInfo, load_credentials
from runtime.messages import DeviceSummary, FleetSummary
from runtime.pki import SiteCA
from runtime.security import Identity

__all__ = ["make_credentials", "summary", "FogSigner"]


def make_credentials(d: Path, name: str, fog: FogSigner, mqtt: str = "") -> Credentials:
    """A coordinator credentials directory pinning ``fog`` (TLS files are real but unused with --insecure)."""
    d.mkdir(parents=True, exist_ok=True)
    ca = SiteCA.load_or_create(d.parent / f"{d.name}-ca", fog.site)
    ca.issue_bundle(d, name, "coordinator")
    Identity.generate(name).save(d / "signing.key")
    (d / "identity.json").write_text(json.dumps({"name": name, "role": "coordinator"}))
    (d / "fog.json").write_text(json.dumps(FogInfo(fog.fog_id, fog.site, fog.public_key, mqtt).to_json()))
    for secret in ("key.pem", "signing.key"):
        os.chmod(d / secret, 0o600)
    return load_credentials(d)


def summary(fog: FogSigner, devices: tuple[str, ...] = ("dev-0",), *, fog_id: str | None = None,
            site: str | None = None, ts: float | None = None) -> FleetSummary:
    return FleetSummary(fog_id or fog.fog_id, site or fog.site, time.time() if ts is None else ts,
                        tuple(DeviceSummary(d, True, 0.9, fit_for_training=True) for d in devices))


# ------------------------------------------------------------------ real Flower deployments

import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from runtime.broker import free_port  # noqa: E402

VENV_BIN = Path(sys.executable).parent


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """kill -9 of a process started in its own session, with everything it started."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        pass


class Deployment:
    """Authorized SuperNodes (own keys), impostors, and ``fogline coordinator`` runs, all on 127.0.0.1."""

    def __init__(self, root: Path, env: dict[str, str] | None = None) -> None:
        self.root = root
        self.ck = root / "ck"
        self.host = "127.0.0.1"  # the SuperLink address devices dial (a test may use another loopback address)
        self.port = free_port()
        self.env = dict(env or os.environ)
        self.env.update({"PATH": f"{VENV_BIN}{os.pathsep}{self.env.get('PATH', '')}", "FLWR_TELEMETRY_ENABLED": "0",
                         "FLWR_DISABLE_UPDATE_CHECK": "1", "PYTHONUNBUFFERED": "1",
                         "FOGLINE_CACHE_DIR": str(root / "cache")})
        self.procs: list[subprocess.Popen[bytes]] = []
        self.keys: dict[str, Path] = {}

    def fogline(self, *argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(VENV_BIN / "fogline"), *argv], capture_output=True, text=True, env=self.env,
                              timeout=60)

    def authorize(self, device: str) -> Path:
        out = self.root / "keys" / device
        assert self.fogline("supernodes", "keygen", "--out", str(out)).returncode == 0
        assert self.fogline("supernodes", "add", device, str(out / "supernode.pub"), "--checkpoint-dir",
                            str(self.ck)).returncode == 0
        self.keys[device] = out / "supernode.key"
        return out / "supernode.key"

    def node(self, name: str, key: Path | None, node_config: str, *, insecure: bool = False) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{name}.log", "wb")  # noqa: SIM115
        cmd = [str(VENV_BIN / "flower-supernode"), "--superlink", f"{self.host}:{self.port}", "--port",
               str(free_port()), "--node-config", node_config]
        if insecure:
            cmd.append("--insecure")
        else:
            cmd += ["--root-certificates", str(self.ck / "superlink-tls" / "ca.pem")]
            if key is not None:
                cmd += ["--auth-supernode-private-key", str(key)]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**self.env, "FLWR_HOME": str(
            self.root / f"home-{name}")}, start_new_session=True)
        log.close()
        self.procs.append(proc)
        return proc

    def coordinator(self, *argv: str, log_name: str = "coordinator", cwd: Path | None = None
                    ) -> subprocess.Popen[bytes]:
        log = open(self.root / f"{log_name}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen([str(VENV_BIN / "fogline"), "-v", "coordinator", "--checkpoint-dir", str(self.ck),
                                 "--superlink", f"{self.host}:{self.port}", *argv],
                                stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True, cwd=cwd)
        log.close()
        self.procs.append(proc)
        return proc

    def wait_file(self, path: Path, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not path.exists():
            assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout} s"
            time.sleep(0.2)

    def wait_exit(self, proc: subprocess.Popen[bytes], timeout: float, log_name: str = "coordinator") -> int:
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            kill_tree(proc)
            raise AssertionError(f"coordinator did not finish in {timeout} s:\n"
                                 f"{(self.root / f'{log_name}.log').read_text()[-3000:]}") from None

    def close(self) -> None:
        for p in reversed(self.procs):
            kill_tree(p)
