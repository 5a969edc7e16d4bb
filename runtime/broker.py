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
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from . import children
from .brokerproc import BrokerProcess, free_port, port_open, wait_port
from .errors import LocalViolation
from .files import atomic_write
from .ids import ID_GRAMMAR, ID_PATTERN, is_id
from .topics import ROOT

if TYPE_CHECKING:
    from .mqtt import TlsConfig

__all__ = ["BrokerConfig", "BrokerProcess", "MosquittoBroker", "acl_for", "check_acl", "find_mosquitto", "free_port",
           "port_open", "wait_port", "start_broker"]

log = logging.getLogger(__name__)


def find_mosquitto() -> str | None:
    found = shutil.which("mosquitto")
    if found:
        return found
    for candidate in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto"):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


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
    # connections held at once, those still in their TLS handshake included: a flood of bare
    # connects is refused past it instead of taking every descriptor the broker has (its
    # connected devices go on being served). Above a site's devices and identities; -1: no cap.
    max_connections: int = 4096


_PERSIST = "mosquitto.db"  # mosquitto's persistence file in ``persistence_location``


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

    mosquitto 2.0 that fails to reload an ACL keeps running *without* one (every client may read
    and write everything), and refuses to start with it. So a new ACL or CRL is checked line by
    line (``check_acl``), then test-loaded by a throwaway mosquitto with the same config on a
    free port, and only then written (atomically, fsynced) and reloaded; a refused one leaves
    the last good file in place. ``acl.good`` keeps the last file mosquitto accepted, and a
    start that fails with the current files starts again with it.
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
        self._conf_lines: list[str] = []
        self.refused: dict[str, int] = {"acl": 0, "crl": 0}  # updates refused by the checks (counted)
        # name -> TLS for a short-lived certificate under that name (``SiteCA.closer_bundle``), in
        # ``target``: set by the fog so that revoking an identity closes its live session at once
        self.session_closer: Callable[[str, Path], TlsConfig] | None = None
        self._gone: set[str] = set()  # identities the last ACLs dropped: their sessions are closed
        self.closed_sessions = 0

    # ------------------------------------------------------------ files

    def _owned(self, path: Path) -> None:
        """Hand a file or directory we wrote to the broker user (only when we run as root)."""
        if self.run_dir == self.data_dir:
            return
        import pwd
        try:
            pw = pwd.getpwnam(self.config.run_as)
        except KeyError:
            raise LocalViolation(f"user {self.config.run_as!r} does not exist: mosquitto must not run as "
                                 "root (the Debian package creates 'mosquitto')") from None
        os.chown(path, pw.pw_uid, pw.pw_gid)

    def _user(self) -> str | None:
        """Who mosquitto runs as: we switch to ``run_as`` ourselves when root (mosquitto's own drop of
        privileges would clear the parent-death signal that ties it to the fog broker)."""
        return self.config.run_as if self.run_dir != self.data_dir and os.geteuid() == 0 else None

    def _put(self, name: str, data: bytes, mode: int = 0o600) -> Path:
        """Atomically (fsynced temp file, rename, fsynced dir): mosquitto never reads half a file."""
        path = self.run_dir / name
        atomic_write(path, data, mode=mode, sync_dir=True)
        self._owned(path)  # before any SIGHUP: only a reload makes mosquitto read it
        return path

    def _scratch(self, name: str, data: bytes, mode: int = 0o600) -> Path:
        """A file only a test load reads, then deleted: written whole, but not made durable (no fsync)."""
        path = self.run_dir / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
        self._owned(path)
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
        if self.run_dir != self.data_dir and not self.run_dir.parent.exists():
            # the broker user must traverse it, whatever umask the fog runs with (0077)
            self.run_dir.parent.mkdir(parents=True, exist_ok=True)
            os.chmod(self.run_dir.parent, 0o755)
        self.run_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.run_dir, 0o700)
        self._owned(self.run_dir)
        if self.run_dir != self.data_dir:
            self._claim_run_dir()
            self._restore_persistence()
        lines = [
            "per_listener_settings false",
            f"listener {self.port} {self.host}",
            f"max_connections {int(c.max_connections)}",
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
            try:
                check_acl(c.acl)
                acl = c.acl
            except LocalViolation as exc:  # never hand mosquitto a line it may misread: the last good one
                self.refused["acl"] += 1
                acl = self._last_good_acl()
                log.error("refusing the new ACL (%s); mosquitto starts with the last good one", exc)
            lines.append(f"acl_file {self._put('acl', acl.encode()).resolve()}")
        self._conf_lines = lines
        self.conf_path = self._put("mosquitto.conf", ("\n".join(lines) + "\n").encode(), 0o644)
        return self.conf_path

    def _last_good_acl(self) -> str:
        """``acl.good`` when it still passes the checks, else an ACL that grants nothing."""
        for where in (self.run_dir, self.data_dir):  # the data dir's copy: kept when the broker stopped
            try:
                text = (where / "acl.good").read_text()
                check_acl(text)
                return text
            except (OSError, UnicodeDecodeError, LocalViolation):
                continue
        return "# fogline: no valid ACL yet; every topic is denied\n"

    def update_acl(self, text: str) -> bool:
        """Replace the ACL and reload: rights change for connected clients too (any thread).

        False (logged, counted in ``refused``) when the text fails ``check_acl`` or a test load:
        mosquitto keeps the last good ACL."""
        try:
            check_acl(text)
        except LocalViolation as exc:
            return self._refuse("acl", str(exc))
        try:
            before = _acl_users((self.run_dir / "acl").read_text())
        except OSError:
            before = set()
        if not self._install("acl", "acl_file", text.encode()):
            return False
        now = _acl_users(text)
        self._gone = (self._gone | (before - now)) - now
        self._close_gone()
        return True

    def update_crl(self, pem: bytes) -> bool:
        """Replace the revocation list and reload: a revoked certificate cannot connect again (any thread).

        False (logged, counted) when it is not a PEM CRL or mosquitto refuses it: the last good one stays."""
        from cryptography import x509

        try:
            x509.load_pem_x509_crl(pem)
        except ValueError as exc:
            return self._refuse("crl", f"not a PEM CRL ({exc})")
        if not self._install("crl", "crlfile", pem, name="crl.pem"):
            return False
        self._close_gone()  # a revoked identity that reconnected before its certificate was listed
        return True

    def _close_gone(self) -> None:
        if self._gone and self.session_closer is not None and self.alive():
            threading.Thread(target=self.close_sessions, args=(sorted(self._gone),), daemon=True,
                             name="mqtt-close-revoked").start()

    def close_sessions(self, names: Iterable[str], timeout: float = 10.0) -> int:
        """Close the live MQTT sessions of ``names`` (identities the ACL no longer lists: revoked).

        mosquitto keeps a connected client's session when its rights or its certificate go; a
        connection under the same name takes that session over (the client id is the certificate's
        CN, so only the CA can make one), is told nothing (no rights), and leaves: the revoked
        client is disconnected, and its certificate, in the CRL, cannot connect again. The
        closing certificate lives a few minutes, in a temporary directory removed at once.
        """
        from .mqtt import MqttClient

        closer = self.session_closer
        if closer is None:
            return 0
        closed = 0
        for name in names:
            with tempfile.TemporaryDirectory(prefix="fogline-close-") as tmp:
                try:
                    c = MqttClient(name, self.host, self.port, tls=closer(name, Path(tmp)), max_queued=0)
                except (LocalViolation, OSError, ValueError) as exc:
                    log.warning("cannot close %s's MQTT session: %s", name, exc)
                    continue
                c.start()
                try:
                    if c.wait_connected(timeout):
                        closed += 1
                    else:
                        log.warning("cannot close %s's MQTT session: %s", name, c.last_error)
                finally:
                    c.stop()
        if closed:
            self.closed_sessions += closed
            log.info("closed the MQTT sessions of %d revoked identities", closed)
        return closed

    def _refuse(self, what: str, why: str) -> bool:
        self.refused[what] += 1
        log.error("refusing the new %s for mosquitto: %s; the last good one stays", what.upper(), why)
        return False

    def _install(self, what: str, directive: str, data: bytes, *, name: str = "") -> bool:
        name = name or what
        with self._files_lock:
            try:
                if (self.run_dir / name).read_bytes() == data:
                    return True  # already in force (the enrolment and the fog's trust sync both push it)
            except OSError:
                pass
            candidate = self._scratch(f"{name}.next", data)
            problem = self.test_load({directive: candidate})
            if problem is not None:
                candidate.unlink(missing_ok=True)
                return self._refuse(what, problem)
            self._put(name, data)
            candidate.unlink(missing_ok=True)
            self.reload()
            if what == "acl":  # the rollback target: an older copy after a crash is still a good one
                atomic_write(self.run_dir / "acl.good", data)
                self._owned(self.run_dir / "acl.good")
        return True

    def test_load(self, files: Mapping[str, Path], timeout: float = 10.0) -> str | None:
        """Start a throwaway mosquitto with this broker's config, ``files`` (directive -> path, e.g.
        ``acl_file``) swapped in, on a free loopback port: None when it comes up, else why not."""
        exe = find_mosquitto()
        if exe is None or not self._conf_lines:
            return None  # nothing to test with (the config is written at start)
        for _attempt in range(3):  # the free port may be taken between free_port() and the bind
            port = free_port()
            lines = []
            for line in self._conf_lines:
                key = line.split(" ", 1)[0]
                if key == "listener":
                    line = f"listener {port} 127.0.0.1"
                elif key in ("persistence_location", "autosave_interval"):
                    continue
                elif key == "persistence":
                    line = "persistence false"
                elif key in files:
                    line = f"{key} {Path(files[key]).resolve()}"
                lines.append(line)
            conf = self._scratch("mosquitto.test.conf", ("\n".join(lines) + "\n").encode(), 0o644)
            proc = children.spawn([exe, "-c", str(conf)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  user=self._user())
            try:
                deadline = time.monotonic() + timeout
                while proc.poll() is None and time.monotonic() < deadline:
                    if port_open("127.0.0.1", port, 0.2):
                        return None
                    time.sleep(0.005)
                if proc.poll() is None:
                    return f"a test mosquitto did not open port {port} within {timeout:g} s"
            finally:
                if proc.poll() is None:
                    proc.kill()
                out = proc.communicate(timeout=5)[0].decode("utf-8", "replace")
                conf.unlink(missing_ok=True)
            if "in use" not in out:
                errors = [ln.split(": ", 1)[-1] for ln in out.splitlines() if "Error" in ln]
                return "mosquitto refused it: " + (" ".join(errors)[:300] or f"exit code {proc.returncode}")
        return "a test mosquitto found no free port"

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
        self._remove_run_dir()

    def _remove_run_dir(self) -> None:
        """A stopped broker leaves no run dir under /var/lib/fogline: it held a copy of the broker's
        private key. Its persistence (sessions, retained messages) moves to the data dir, and
        ``write_config`` brings it back on the next start."""
        if self.run_dir == self.data_dir or not self.run_dir.is_dir():
            return
        for name in (_PERSIST, "acl.good"):  # sessions and retained messages; the ACL to fall back on
            kept = self.run_dir / name
            if kept.is_file():
                atomic_write(self.data_dir / name, kept.read_bytes(), mode=0o600)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _restore_persistence(self) -> None:
        saved, db = self.data_dir / _PERSIST, self.run_dir / _PERSIST
        if self.run_dir != self.data_dir and saved.is_file() and not db.exists():
            self._put(_PERSIST, saved.read_bytes())

    def start(self, timeout: float = 10.0) -> MosquittoBroker:
        exe = find_mosquitto()
        if exe is None:
            raise LocalViolation("mosquitto not found: install the Debian package 'mosquitto'")
        self.write_config()
        if not self._spawn(exe, timeout):
            acl = self.run_dir / "acl"
            good = self.run_dir / "acl.good"
            if self.config.acl is None or not good.exists() or good.read_bytes() == acl.read_bytes():
                raise LocalViolation(f"mosquitto did not open port {self.port}; see {self.log_path}")
            log.error("mosquitto did not start with the new ACL; starting it with the last good one")
            self._put("acl", self._last_good_acl().encode())
            if not self._spawn(exe, timeout):
                raise LocalViolation(f"mosquitto did not open port {self.port}; see {self.log_path}")
        if self.config.acl is not None:
            self._put("acl.good", (self.run_dir / "acl").read_bytes())  # what this mosquitto accepted
        return self

    def _spawn(self, exe: str, timeout: float) -> bool:
        # the log is the broker's (0600 whatever the umask): it names clients and their addresses
        fd = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.fchmod(fd, 0o600)
        try:  # dies with the fog broker, kill -9 included: a crashed fog leaves no orphan broker behind
            self.proc = children.spawn([exe, "-c", str(self.conf_path)], stdout=fd, stderr=subprocess.STDOUT,
                                       user=self._user())
        finally:
            os.close(fd)
        if wait_port(self.host, self.port, timeout):
            return True
        super().stop()
        return False


def acl_for(site: str, fog_id: str, identities: Mapping[str, str]) -> str:
    """The site's ACL: explicit rights per identity (name -> role); no patterns, so an identity
    removed from the map (a revoked device) keeps no right at all after the reload.

    Every topic an identity writes carries its own name (``runtime.topics``): the broker checks
    it against the name it authenticated (certificate CN == username == client id), so the fog
    can key budgets and quarantines by the topic and no one acts in another's name.

    * fog: everything under the site;
    * device: write its own BIRTH/STATE/DEATH/ACK, read its own CMD, its activations
      (``dev/{name}/ACT/+``), ``fog/STATE``, ``fog/REBIRTH`` and ``fog/TIME``; the data plane:
      forward activations to any device under its own name (``dev/+/ACT/{name}``; each is sealed
      by the sender and carries a fog-signed route) and answer the fog (``reply/{fog}/{name}``);
    * operator, coordinator, app, monitor: control and inference requests under their own name
      (``fog/CTL/{name}``, ``fog/INFER/{name}``; the fog decides per role what each may ask),
      their own replies, the fog's STATE;
    * coordinator: also releases under its own name (``cloud/RELEASE/{name}``) and the fleet summary.
    """
    for what, value in (("site name", site), ("fog id", fog_id)):
        if not is_id(value):
            raise LocalViolation(f"invalid {what} {value[:40]!r}: {ID_GRAMMAR}")
    b = f"{ROOT}/{site}"
    lines = [f"# generated by fogline for site {site}; do not edit", "", f"user {fog_id}", f"topic readwrite {b}/#", ""]
    skipped = [name for name in identities if not is_id(name)]
    if skipped:  # stored before names were checked whole (e.g. "a\n"): never a line of the ACL
        log.warning("ACL: %d identities with invalid names get no rights: %s", len(skipped),
                    ", ".join(repr(n[:40]) for n in sorted(skipped)[:5]))
    for name in sorted(identities):
        role = identities[name]
        if name == fog_id or role == "fog" or not is_id(name):
            continue
        lines.append(f"user {name}")
        if role == "device":
            lines += [f"topic write {b}/dev/{name}/{leaf}" for leaf in ("BIRTH", "STATE", "DEATH", "ACK")]
            lines += [f"topic read {b}/dev/{name}/CMD", f"topic read {b}/dev/{name}/ACT/+",
                      f"topic read {b}/fog/STATE", f"topic read {b}/fog/REBIRTH", f"topic read {b}/fog/TIME",
                      f"topic write {b}/dev/+/ACT/{name}", f"topic write {b}/reply/{fog_id}/{name}"]
        elif role in ("operator", "coordinator", "app", "monitor"):
            lines += [f"topic write {b}/fog/INFER/{name}", f"topic write {b}/fog/CTL/{name}",
                      f"topic read {b}/reply/{name}", f"topic read {b}/fog/STATE"]
            if role == "coordinator":
                lines += [f"topic write {b}/cloud/RELEASE/{name}", f"topic read {b}/fog/SUMMARY"]
        lines.append("")
    return "\n".join(lines)


def _acl_users(text: str) -> set[str]:
    """The identities an ACL text names (``acl_for``: one ``user NAME`` line each)."""
    return {line[len("user "):] for line in text.split("\n") if line.startswith("user ")}


_ACL_LINE = re.compile(  # comment | blank | user ID | topic ACCESS FILTER (levels: ids, + ; # last)
    rf"(?:# [^\x00-\x1f\x7f]*|user {ID_PATTERN}|topic (?:read|write|readwrite) "
    rf"(?:{ID_PATTERN}|\+)(?:/(?:{ID_PATTERN}|\+))*(?:/#)?|)")


def check_acl(text: str) -> None:
    """LocalViolation naming the first line of ``text`` that is not one ``acl_for`` writes: a comment,
    a blank, ``user ID`` or ``topic read|write|readwrite FILTER`` whose levels are ids or wildcards."""
    for no, line in enumerate(text.split("\n"), 1):
        if _ACL_LINE.fullmatch(line) is None or (".." in line and not line.startswith("# ")):
            raise LocalViolation(f"ACL line {no} is not a comment, 'user ID' or 'topic ACCESS FILTER': "
                                 f"{line[:60]!r}")


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
