"""Start and stop an MQTT broker on 127.0.0.1: mosquitto when installed.

The fog broker owns its site's MQTT broker. We generate mosquitto's config
(port, persistence, keepalive limit, optionally TLS with per-device
certificates and an ACL that confines each device to its own topic
subtree) and supervise the process. When mosquitto is missing, the
zero-install fallback (see ``runtime.fallback_broker``) is used with a loud
warning, because it is slower and less proven.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from .errors import LocalViolation
from .topics import ROOT

__all__ = ["BrokerConfig", "BrokerProcess", "MosquittoBroker", "find_mosquitto", "free_port", "port_open", "wait_port", "start_broker"]

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
    data_dir: Path
    port: int = 0  # 0: pick a free port
    host: str = "127.0.0.1"
    max_keepalive: int = 60
    persistence: bool = True
    tls_dir: Path | None = None  # a directory made by runtime.pki.make_site_pki
    acl: bool = False


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


class MosquittoBroker(BrokerProcess):
    """A supervised mosquitto process with a generated config."""

    def __init__(self, config: BrokerConfig) -> None:
        self.config = config
        self.port = config.port or free_port()
        self.host = config.host
        self.proc: subprocess.Popen[bytes] | None = None
        self.data_dir = Path(config.data_dir)
        self.conf_path = self.data_dir / "mosquitto.conf"
        self.log_path = self.data_dir / "mosquitto.log"

    def write_config(self) -> Path:
        c = self.config
        self.data_dir.mkdir(parents=True, exist_ok=True)
        lines = [
            "per_listener_settings false",
            f"listener {self.port} {self.host}",
            f"max_keepalive {c.max_keepalive}",
            "max_queued_messages 10000",
            "max_inflight_messages 100",
            "message_size_limit 0",
            # without it each small broker->client write waits on Nagle + delayed ACK (~40 ms a hop)
            "set_tcp_nodelay true",
            f"persistence {'true' if c.persistence else 'false'}",
            f"persistence_location {self.data_dir.resolve()}/",
            "autosave_interval 1",
            "log_dest stderr",
            "log_type error",
            "log_type warning",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            # mosquitto started as root drops to user 'mosquitto', which then
            # cannot write persistence into (or read keys from) our data dir
            lines.append("user root")
        if c.tls_dir is not None:
            tls = Path(c.tls_dir).resolve()
            lines += [
                f"cafile {tls / 'ca.pem'}",
                f"certfile {tls / 'broker.pem'}",
                f"keyfile {tls / 'broker.key'}",
                "require_certificate true",
                "use_identity_as_username true",
                "allow_anonymous false",
            ]
        else:
            lines.append("allow_anonymous true")
        if c.acl:
            fogs, clouds = _identities(c.tls_dir)
            acl_path = self.data_dir / "acl"
            acl_path.write_text(acl_text(fogs, clouds))
            lines.append(f"acl_file {acl_path.resolve()}")
        self.conf_path.write_text("\n".join(lines) + "\n")
        return self.conf_path

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



def _identities(tls_dir: Path | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Fog and cloud client ids recorded by ``runtime.pki.make_site_pki`` (none without TLS)."""
    if tls_dir is None:
        return (), ()
    path = Path(tls_dir) / "identities.json"
    if not path.exists():
        return (), ()
    try:
        ids = json.loads(path.read_text())
        return tuple(map(str, ids.get("fogs", ()))), tuple(map(str, ids.get("clouds", ())))
    except (ValueError, AttributeError, TypeError) as exc:
        raise LocalViolation(f"{path}: unreadable identities ({exc})") from None


def acl_text(fog_ids: Sequence[str] = (), cloud_ids: Sequence[str] = ()) -> str:
    """Each device (certificate CN = username) may write only under its own subtree.

    Fog brokers and coordinators are listed explicitly (``runtime.pki`` records
    their ids): a fog broker owns its site's namespace, a coordinator reads fog
    summaries and state, publishes releases and control requests, and reads its
    replies. Devices get identity-scoped patterns; the two exceptions are the
    unsigned data plane of docs/protocol.md (a hop forwards ``Activation`` to the
    next device's ``ACT`` and the last hop answers on ``reply/{client}``), so a
    device can never write another device's BIRTH/STATE/DEATH/ACK/CMD or any
    ``fog/`` or ``cloud/`` topic.
    """
    lines = ["# fog brokers and the coordinator (ids from runtime.pki)"]
    for fog in fog_ids:
        lines += [f"user {fog}", f"topic readwrite {ROOT}/#", ""]
    for cloud in cloud_ids:
        lines += [f"user {cloud}",
                  f"topic read {ROOT}/+/fog/STATE",
                  f"topic read {ROOT}/+/fog/SUMMARY",
                  f"topic readwrite {ROOT}/+/cloud/#",
                  f"topic write {ROOT}/+/fog/CTL",
                  f"topic write {ROOT}/+/fog/INFER",
                  f"topic read {ROOT}/+/reply/{cloud}",
                  ""]
    lines += [
        "# devices: identity-scoped patterns (patterns apply to every user)",
        f"pattern write {ROOT}/+/dev/%u/#",
        f"pattern read {ROOT}/+/dev/%u/#",
        f"pattern read {ROOT}/+/fog/#",
        f"pattern read {ROOT}/+/reply/%u",
        "# data plane: forward activations to the next hop, answer the requester",
        f"pattern write {ROOT}/+/dev/+/ACT",
        f"pattern write {ROOT}/+/reply/+",
        "",
    ]
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
