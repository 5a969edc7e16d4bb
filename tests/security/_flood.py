"""The one flood helper of the security tests: an attacker that follows none of our protocol, and a probe.

``attack`` starts a plain paho client (not our adapter) in its own process (its own CPU, as on the
LAN) holding real credentials; it publishes ``once`` a single time each (QoS 1, waited for), then
cycles through ``frames`` at QoS 0 as fast as its socket takes them (or at ``rate`` a second) for
``seconds`` (every 1,000th publish waits until it is written), or sends each frame once when
``repeat`` is False. ``sent``
waits for it and returns how many it published. ``Probe`` is an honest identity asking for status
(and optionally inferring) in a loop on its own connection, recording what it saw.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from simulations.local_site import LocalSite

REPO = Path(__file__).resolve().parents[2]
Tls = tuple[str, str, str]  # (ca, cert, key)

ATTACKER = r"""
import json, sys, time
import paho.mqtt.client as mqtt
spec = json.loads(open(sys.argv[1]).read())
frames = [(t, bytes.fromhex(p)) for t, p in spec["frames"]]
c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=spec["client_id"], protocol=mqtt.MQTTv311)
c.tls_set(ca_certs=spec["ca"], certfile=spec["cert"], keyfile=spec["key"])
c.tls_insecure_set(True)  # an attacker does not care which name the broker's certificate carries
c.connect("127.0.0.1", spec["port"], 30)
c.loop_start()
end = time.monotonic() + 10
while not c.is_connected() and time.monotonic() < end:
    time.sleep(0.01)
assert c.is_connected(), "attacker could not connect"
for t, p in spec["once"]:
    c.publish(t, bytes.fromhex(p), qos=1).wait_for_publish(10)
sent, start, last = 0, time.monotonic(), None
end = start + spec["seconds"]
while time.monotonic() < end:
    for t, p in frames:
        last = c.publish(t, p, qos=0)
        sent += 1
        if sent % 1000 == 0:
            last.wait_for_publish(10)
        if spec["rate"] and sent % 50 == 0 and (ahead := start + sent / spec["rate"] - time.monotonic()) > 0:
            time.sleep(ahead)
    if not spec["repeat"]:
        break
if last is not None:
    last.wait_for_publish(10)
c.disconnect()
c.loop_stop()
print(json.dumps({"sent": sent}), flush=True)
"""


def attack(port: int, root: Path, client_id: str, tls: Tls, frames: Sequence[tuple[str, bytes]], seconds: float,
           once: Sequence[tuple[str, bytes]] = (), repeat: bool = True, rate: float = 0.0
           ) -> subprocess.Popen[str]:
    spec = {"client_id": client_id, "port": port, "ca": tls[0], "cert": tls[1], "key": tls[2], "seconds": seconds,
            "repeat": repeat, "rate": rate, "frames": [(t, p.hex()) for t, p in frames],
            "once": [(t, p.hex()) for t, p in once]}
    path = root / f"attack-{client_id}-{time.time_ns()}.json"
    path.write_text(json.dumps(spec))
    return subprocess.Popen([sys.executable, "-c", ATTACKER, str(path)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def sent(proc: subprocess.Popen[str], seconds: float) -> int:
    out, err = proc.communicate(timeout=seconds + 60)
    assert proc.returncode == 0, err[-2000:]
    return int(json.loads(out.strip().splitlines()[-1])["sent"])


def device_tls(root: Path, dev: str) -> Tls:
    """An enrolled device's TLS files (``edge_agent.enrol`` layout)."""
    tls = root / dev / "tls"
    return str(tls / "ca.pem"), str(tls / "cert.pem"), str(tls / "key.pem")


def issued_tls(site: LocalSite, name: str) -> Tls:
    """An issued identity's TLS files (``fogline operators add``)."""
    from runtime.credentials import load_credentials
    t = load_credentials(site.credentials(name)).tls
    return str(t.ca_file), str(t.cert_file), str(t.key_file)


@dataclass
class Probe:
    """One identity asking for status (and optionally inferring) in a loop, on its own connection."""

    site: LocalSite
    name: str
    infer: bool = False
    period: float = 0.25
    samples: list[tuple[float, float, dict[str, Any]]] = field(default_factory=list)  # (at, took, status)
    errors: list[str] = field(default_factory=list)
    inferences: list[tuple[float, str]] = field(default_factory=list)  # (took, "ok" | error)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _status(self) -> None:
        with self.site.client(self.name) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    st = c.status(timeout=15)
                    self.samples.append((t0, time.monotonic() - t0, st))
                except Exception as exc:  # noqa: BLE001 - recorded, asserted on by the test
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                self._stop.wait(self.period)

    def _infer(self) -> None:
        x = np.random.default_rng(3).standard_normal((1, 64)).astype(np.float32)
        with self.site.client() as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    c.infer("w", {"x": x}, timeout=5)
                    self.inferences.append((time.monotonic() - t0, "ok"))
                except Exception as exc:  # noqa: BLE001 - recorded, asserted on by the test
                    self.inferences.append((time.monotonic() - t0, f"{type(exc).__name__}: {exc}"))
                self._stop.wait(0.5)

    def __enter__(self) -> Probe:
        for fn in [self._status] + ([self._infer] if self.infer else []):
            t = threading.Thread(target=fn, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(30)


def alive(st: dict[str, Any]) -> set[str]:
    return {d["id"] for d in st["devices"] if d["alive"]}
