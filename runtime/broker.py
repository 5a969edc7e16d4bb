"""Start and stop an MQTT broker on 127.0.0.1: mosquitto when installed.

The fog broker owns its site's MQTT broker. We generate mosquitto's config
(port, persistence, keepalive limit, optionally TLS with per-device
certificates and an ACL that confines each device to its own topic
subtree) and supervise the process. When mosquitto is missing, the
zero-install fallback (see ``runtime.fallback_broker``) is used with a loud
warning, because it is slower and less proven.
"""
from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from .errors import LocalViolation
from .topics import ROOT

__all__ = ["BrokerConfig", "BrokerProcess", "MosquittoBroker", "acl_for", "find_mosquitto", "free_port", "port_open",
           "wait_port", "start_broker"]

log = logging.getLogger(__name__)


def find_mosquitto() -> str | None:
    found = shutil.which("mosquitto")
    if found:
        return found
    for candidate in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_open(host: str, port: int, timeout_s: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def wait_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return True
        except OSError:
            time.sleep(0.02)
    return False


@dataclass(frozen=True, slots=True)
class BrokerConfig:
    """A mosquitto to start. With ``tls_dir`` it is the hardened site broker of docs/security.md."""

    data_dir: Path
    port: int = 0  # 0: pick a free port
    host: str = "127.0.0.1"
    max_keepalive: int = 60
    persistence: bool = True
    # ca.pem, broker.pem, broker.key, crl.pem: TLS with required client certificates whose CN is
    # both the username and the client id; None: plain TCP with anonymous clients (tests, --insecure)
    tls_dir: Path | None = None
    acl: str | None = None         # ACL text (``acl_for``); None: no ACL file
    max_message_bytes: int = 0     # mosquitto's message_size_limit; 0: none (insecure test brokers only)
    run_as: str = "mosquitto"      # the unprivileged user mosquitto drops to when started as root


class BrokerProcess:
    """What every broker we launch offers: a child process we can check, stop or kill."""

    host: str
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> "BrokerProcess":
        raise NotImplementedError

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests use it)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=5)
        self._exited()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self._exited()

    def _exited(self) -> None:
        """Release what the child held (subclasses)."""

    def __enter__(self) -> "BrokerProcess":
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _run_dir(data_dir: Path) -> Path:
    """Where mosquitto reads and writes: ``data_dir``, or (started as root) a directory the
    unprivileged broker user owns under /var/lib/fogline, since it cannot reach a root-only data dir."""
    if not (hasattr(os, "geteuid") and os.geteuid() == 0):
        return data_dir
    base = Path(os.environ.get("FOGLINE_MQTT_RUNDIR", "/var/lib/fogline"))
    tag = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    return base / f"mqtt-{tag}"


class MosquittoBroker(BrokerProcess):
    """A supervised mosquitto process with a generated config.

    Hardened by ``BrokerConfig.tls_dir``: TLS 1.2+ with required client certificates and a CRL,
    no anonymous clients, the certificate CN as username and client id (no one can take over
    another identity's session), a per-identity ACL, a message size limit, and never root:
    started as root, mosquitto drops to ``run_as`` and works in a directory that user owns.
    ``update_acl`` / ``update_crl`` rewrite those files and reload the broker (SIGHUP): new
    rights apply to connected clients at once, a revoked certificate cannot connect again.
    """

    def __init__(self, config: BrokerConfig, *, pid: int | None = None) -> None:
        self.config = config
        self.port = config.port or free_port()
        self.host = config.host
        self.proc: subprocess.Popen[bytes] | None = None
        self.pid = pid  # a mosquitto adopted from a previous run of the fog broker
        self._files_lock = threading.Lock()  # enrolment threads and the fog's owner thread both update
        self.data_dir = Path(config.data_dir)
        self.run_dir = _run_dir(self.data_dir)
        self.conf_path = self.run_dir / "mosquitto.conf"
        self.log_path = self.data_dir / "mosquitto.log"

    # ------------------------------------------------------------ files

    def _owned(self, path: Path) -> None:
        """Hand a file or directory we wrote to the broker user (only when we run as root)."""
        if self.run_dir == self.data_dir:
            return
        import pwd  # noqa: PLC0415 - POSIX only, root only
        try:
            pw = pwd.getpwnam(self.config.run_as)
        except KeyError:
            raise LocalViolation(f"user {self.config.run_as!r} does not exist: mosquitto must not run as "
                                 "root (the Debian package creates 'mosquitto')") from None
        os.chown(path, pw.pw_uid, pw.pw_gid)

    def _put(self, name: str, data: bytes, mode: int = 0o600) -> Path:
        path = self.run_dir / name
        tmp = path.with_name(name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.chmod(tmp, mode)
        self._owned(tmp)
        os.replace(tmp, path)
        return path

    def _claim_run_dir(self) -> None:
        """The run dir outlives a deleted data dir at the same path: a new data dir (a new instance
        id) must not inherit the old broker's retained messages and sessions."""
        mark = self.data_dir / ".mqtt-instance"
        if not mark.exists():
            mark.write_text(os.urandom(16).hex())
        instance = mark.read_text().strip()
        theirs = self.run_dir / "instance"
        if not theirs.exists() or theirs.read_text().strip() != instance:
            for p in self.run_dir.iterdir():
                if p.is_file():
                    p.unlink()
            self._put("instance", instance.encode(), 0o644)

    def write_config(self) -> Path:
        c = self.config
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.run_dir, 0o700)
        self._owned(self.run_dir)
        if self.run_dir != self.data_dir:
            self._claim_run_dir()
        lines = [
            "per_listener_settings false",
            f"listener {self.port} {self.host}",
            f"max_keepalive {c.max_keepalive}",
            "max_queued_messages 10000",
            "max_inflight_messages 100",
            f"message_size_limit {int(c.max_message_bytes)}",
            # refuse an oversized packet at its header, before mosquitto buffers it (0: no limit)
            *([f"max_packet_size {int(c.max_message_bytes) + 65536}"] if c.max_message_bytes else []),
            # without it each small broker->client write waits on Nagle + delayed ACK (~40 ms a hop)
            "set_tcp_nodelay true",
            f"persistence {'true' if c.persistence else 'false'}",
            f"persistence_location {self.run_dir.resolve()}/",
            "autosave_interval 1",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
        ]
        if self.run_dir != self.data_dir:
            lines.append(f"user {c.run_as}")
        if c.tls_dir is not None:
            tls = Path(c.tls_dir)
            for name in ("ca.pem", "broker.pem", "broker.key", "crl.pem"):
                self._put(name, (tls / name).read_bytes())
            d = self.run_dir.resolve()
            lines += [
                f"cafile {d / 'ca.pem'}",
                f"certfile {d / 'broker.pem'}",
                f"keyfile {d / 'broker.key'}",
                f"crlfile {d / 'crl.pem'}",
                "tls_version tlsv1.2",
                "require_certificate true",
                "use_identity_as_username true",
                "use_username_as_clientid true",
                "allow_anonymous false",
            ]
        else:
            lines.append("allow_anonymous true")
        if c.acl is not None:
            lines.append(f"acl_file {self._put('acl', c.acl.encode()).resolve()}")
        self.conf_path = self._put("mosquitto.conf", ("\n".join(lines) + "\n").encode(), 0o644)
        return self.conf_path

    def update_acl(self, text: str) -> None:
        """Replace the ACL and reload: rights change for connected clients too (any thread)."""
        with self._files_lock:
            self._put("acl", text.encode())
            self.reload()

    def update_crl(self, pem: bytes) -> None:
        """Replace the revocation list and reload: a revoked certificate cannot connect again (any thread)."""
        with self._files_lock:
            self._put("crl.pem", pem)
            self.reload()

    def reload(self) -> None:
        pid = self.proc.pid if self.proc is not None else self.pid
        if pid is None:
            raise LocalViolation("no mosquitto process to reload")
        try:
            os.kill(pid, signal.SIGHUP)
        except OSError as exc:
            raise LocalViolation(f"cannot reload mosquitto (pid {pid}): {exc}") from None

    def alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if self.pid is not None:
            try:
                os.kill(self.pid, 0)
                return True
            except OSError:
                return False
        return False

    def stop(self) -> None:
        if self.proc is None and self.pid is not None:
            try:
                os.kill(self.pid, signal.SIGTERM)
            except OSError:
                pass
            self.pid = None
            return
        super().stop()

    def start(self, timeout: float = 10.0) -> "MosquittoBroker":
        exe = find_mosquitto()
        if exe is None:
            raise LocalViolation("mosquitto not found: install the Debian package 'mosquitto'")
        self.write_config()
        log_file = open(self.log_path, "ab")  # noqa: SIM115 - owned by the process lifetime
        self.proc = subprocess.Popen([exe, "-c", str(self.conf_path)], stdout=log_file,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        log_file.close()
        if not wait_port(self.host, self.port, timeout):
            self.stop()
            raise LocalViolation(f"mosquitto did not open port {self.port}; see {self.log_path}")
        return self


def acl_for(site: str, fog_id: str, identities: Mapping[str, str]) -> str:
    """The site's ACL: explicit rights per identity (name -> role); no patterns, so an identity
    removed from the map (a revoked device) keeps no right at all after the reload.

    * fog: everything under the site;
    * device: write its own BIRTH/STATE/DEATH/ACK, read its own CMD/ACT, ``fog/STATE``,
      ``fog/REBIRTH`` and ``fog/TIME``; the data plane: forward activations to any device's ACT
      (each is sealed by the sender and carries a fog-signed route) and answer the fog;
    * operator, coordinator, app, monitor: control and inference requests (the fog decides per
      role what each may ask), their own replies, the fog's STATE;
    * coordinator: also releases and the fleet summary.
    """
    b = f"{ROOT}/{site}"
    lines = [f"# generated by fogline for site {site}; do not edit", "", f"user {fog_id}", f"topic readwrite {b}/#", ""]
    for name in sorted(identities):
        role = identities[name]
        if name == fog_id or role == "fog":
            continue
        lines.append(f"user {name}")
        if role == "device":
            lines += [f"topic write {b}/dev/{name}/{leaf}" for leaf in ("BIRTH", "STATE", "DEATH", "ACK")]
            lines += [f"topic read {b}/dev/{name}/CMD", f"topic read {b}/dev/{name}/ACT",
                      f"topic read {b}/fog/STATE", f"topic read {b}/fog/REBIRTH", f"topic read {b}/fog/TIME",
                      f"topic write {b}/dev/+/ACT", f"topic write {b}/reply/{fog_id}"]
        elif role in ("operator", "coordinator", "app", "monitor"):
            lines += [f"topic write {b}/fog/INFER", f"topic write {b}/fog/CTL", f"topic read {b}/reply/{name}",
                      f"topic read {b}/fog/STATE"]
            if role == "coordinator":
                lines += [f"topic write {b}/cloud/RELEASE", f"topic read {b}/fog/SUMMARY"]
        lines.append("")
    return "\n".join(lines)


def start_broker(data_dir: Path, port: int = 0, *, host: str = "127.0.0.1",
                 allow_fallback: bool = True) -> BrokerProcess:
    """Start mosquitto, or the embedded fallback (with a loud warning) when it is absent.

    ``FOGLINE_BROKER=fallback`` in the environment picks the fallback even where
    mosquitto is installed (to try the zero-install path).
    """
    forced = os.environ.get("FOGLINE_BROKER", "") == "fallback"
    if find_mosquitto() is not None and not forced:
        return MosquittoBroker(BrokerConfig(data_dir=data_dir, port=port, host=host)).start()
    if not allow_fallback:
        raise LocalViolation("mosquitto not found: install the Debian package 'mosquitto'")
    from .fallback_broker import start_fallback  # lazy: optional dependency

    return start_fallback(data_dir, port, host)
