"""Issue 19: one enrolled device stopped a whole site with one number.

Before: a signed birth with ``tx_j_per_byte=-1`` (or NaN, ``rx_j_per_byte=-1e-3``, a state with
``rtt_s=-1``) passed the message check, the codec, the clamp and the registry, and then
``Registry.fleet()`` raised at every reconcile: placement and repair stopped for every device of
the site, for good, while summaries kept flowing. ``inf``, a negative battery or CPU count passed
everywhere, and ``uplink_bps=-5`` became 1 bit/s.

Now, on a real secure site (``fogline broker``: TLS, ACL, mosquitto) with real agents, an
enrolled device we control sends each bad value in turn, as a real signed advert:

* each one is refused where bytes become a message, counted, and ``fogline status`` names the
  device, the field and the value;
* reconciles keep happening, a deploy is placed on the good devices, and killing a good device
  gets its partition re-placed, while the bad device keeps sending;
* the bad device never holds a partition.
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from runtime.broker import find_mosquitto
from runtime.messages import DeviceBirth, DeviceState, Message
from runtime.mqtt import MqttClient
from runtime.security import Signer
from runtime.topics import Topics
from simulations.local_site import LocalSite

from waiting import wait_for as _wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

T = Topics("default")
EVIL = "evil"

#: (advert, field, value): the report's values, and the ones that passed everywhere
BAD: list[tuple[str, str, Any]] = [
    ("birth", "tx_j_per_byte", -1.0), ("birth", "tx_j_per_byte", math.nan),
    ("birth", "rx_j_per_byte", -1e-3), ("birth", "rx_j_per_byte", math.inf),
    ("birth", "battery_capacity_wh", -5.0), ("birth", "cpu_count", -3), ("birth", "uplink_bps", -5.0),
    ("state", "rtt_s", -1.0),
]


class Device:
    """An enrolled device that signs what we tell it to, skipping our own message checks."""

    def __init__(self, site: LocalSite, data: Path) -> None:
        from edge_agent.agent import load_identity
        from edge_agent.credentials import tls_config
        from edge_agent.enrol import enrol_dirs
        enrol_dirs(site.token(), [(EVIL, data)], "127.0.0.1", int(site.enroll.rsplit(":", 1)[1]), timeout_s=30)
        self.ident = load_identity(data, EVIL)
        self.signer = Signer(self.ident, 1)
        self.lock = threading.Lock()
        self.client = MqttClient(EVIL, "127.0.0.1", site.port, tls=tls_config(data, "fog-default"))
        self.client.start()
        assert self.client.wait_connected(10), self.client.last_error

    def birth(self, **bad: Any) -> DeviceBirth:
        b = DeviceBirth(EVIL, 1, 0, "default", self.ident.public_key_bytes, 5e9, 2_000_000_000, 1e8, 1e8, 0.001,
                        5.0, 2.0, labels={"role": "worker", "power-domain": "pd-evil"}, state_interval_s=1.0)
        return _forge(b, bad)

    def state(self, **bad: Any) -> DeviceState:
        return _forge(DeviceState(EVIL, 1, 0, 1_900_000_000), bad)

    def send(self, msg: Message) -> None:
        leaf = "BIRTH" if isinstance(msg, DeviceBirth) else "STATE"
        with self.lock:
            data = self.signer.seal_bytes(msg, time.time())
            assert self.client.publish(T.device(EVIL, leaf), data, qos=1).wait(10)

    def close(self) -> None:
        self.client.stop()


def wait_for(cond: Any, timeout: float, what: Any = None) -> Any:
    # status is a signed control request under a per-identity budget (10/s): poll gently
    return _wait_for(cond, timeout, what, interval=0.3)


def _forge(msg: Any, bad: dict[str, Any]) -> Any:
    for k, v in bad.items():
        object.__setattr__(msg, k, v)  # what a device that does not run our code can put on the wire
    return msg


def _shown(value: Any) -> str:
    return repr(value)


def _row(st: dict[str, Any], did: str) -> dict[str, Any] | None:
    return next((d for d in st["devices"] if d["id"] == did), None)


def _if_rejected(st: dict[str, Any], want: str) -> dict[str, Any] | None:
    r = _row(st, EVIL)
    return st if r is not None and r["rejected"] == want else None


def _holders(st: dict[str, Any]) -> set[str]:
    return {p["device"] for w in st["workloads"] for r in w["placement"] for p in r["partitions"]}


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalSite, Path]]:
    tmp = tmp_path_factory.mktemp("bad-adverts")
    s = LocalSite(tmp / "fog", args=["--state-interval", "1", "--startup-wait", "2"]).start()
    try:
        yield s, tmp
    finally:
        s.stop()


def test_bad_numbers_never_stop_the_site_and_the_device_never_holds_a_partition(
        site: tuple[LocalSite, Path]) -> None:
    fog, tmp = site
    good = [{"id": "cam", "memory": 1000, "flops": 1e8, "labels": {"role": "source", "power-domain": "pd-cam"}}] + [
        {"id": f"w{i}", "memory": 2_000_000, "flops": 5e9, "labels": {"role": "worker", "power-domain": f"pd{i}"}}
        for i in range(3)]
    procs = {a["id"]: fog.spawn_agents([a], tmp / "agents", tmp / f"agent-{a['id']}.log") for a in good}
    evil = Device(fog, tmp / EVIL)
    c = fog.client()
    try:
        def status() -> dict[str, Any]:
            return c.status()  # type: ignore[no-any-return]

        wait_for(lambda: {d["id"] for d in status()["devices"] if d["alive"]} >= set(procs), 60,
                 "the good devices alive")
        evil.send(evil.birth())
        evil.send(evil.state())
        wait_for(lambda: (r := _row(status(), EVIL)) is not None and r["alive"], 20, "the bad device alive")
        base = status()["counters"]

        # 1. each bad value in turn: refused, counted, named; the site keeps reconciling
        for n, (kind, field, value) in enumerate(BAD, 1):
            if kind == "state":
                evil.send(evil.birth())
                wait_for(lambda: (r := _row(status(), EVIL)) is not None and r["alive"] and not r["rejected"], 20,
                         "a clean birth brings it back")
                evil.send(evil.state(**{field: value}))
            else:
                evil.send(evil.birth(**{field: value}))
            want = f"{'DeviceBirth' if kind == 'birth' else 'DeviceState'}.{field}={_shown(value)}"
            st = wait_for(lambda want=want: _if_rejected(status(), want), 20,
                          lambda want=want: f"status names {want}: {_row(status(), EVIL)}")
            row = _row(st, EVIL)
            assert row is not None and not row["alive"]
            assert st["counters"].get("rejected:out of range", 0) - base.get("rejected:out of range", 0) == n
            r0 = st["counters"].get("reconciles", 0)
            wait_for(lambda r0=r0: status()["counters"].get("reconciles", 0) >= r0 + 3, 20, "reconciles go on")
        assert status()["counters"].get("internal_errors", 0) == base.get("internal_errors", 0)

        # 2. while it keeps sending bad adverts: a deploy is placed on the good devices only
        stop = threading.Event()

        def keep_sending() -> None:
            i = 0
            while not stop.wait(0.3):
                kind, field, value = BAD[i % len(BAD)]
                evil.send(evil.state(**{field: value}) if kind == "state" else evil.birth(**{field: value}))
                i += 1

        sender = threading.Thread(target=keep_sending, daemon=True)
        sender.start()
        try:
            res = c.deploy({"workloads": [{"name": "m", "model": "zoo:mlp", "source": "cam", "sink": "cam",
                                           "replicas": 2, "selectors": {"role": "worker"}}]})
            assert [d["name"] for d in res["deployed"]] == ["m"]
            w = c.wait_running("m", 60)
            held = {p["device"] for r in w["placement"] for p in r["partitions"]}
            assert held and EVIL not in held and held <= {"w0", "w1", "w2"}

            # 3. a good device dies: its partition is re-placed (repair is not stopped either)
            victim = sorted(held)[0]
            os.killpg(procs[victim].pid, signal.SIGKILL)
            procs[victim].wait(10)

            def repaired() -> dict[str, Any] | None:
                st = status()
                wl = next(x for x in st["workloads"] if x["name"] == "m")
                now = {p["device"] for r in wl["placement"] for p in r["partitions"]}
                ok = (wl["healthy_replicas"] == 2 and victim not in now
                      and all(p["phase"] == "running" for r in wl["placement"] for p in r["partitions"]))
                return st if ok else None

            st = wait_for(repaired, 60, lambda: f"re-placed off {victim}: {status()['workloads']}")
            assert EVIL not in _holders(st)
            row = _row(st, EVIL)
            assert row is not None and row["rejected"] and not row["alive"] and not row["partitions"]
        finally:
            stop.set()
            sender.join(10)
        st = status()
        assert st["counters"].get("internal_errors", 0) == base.get("internal_errors", 0)
        assert EVIL not in _holders(st)
        # the operator's view: `fogline status` prints the device, the field and the value
        from fog_broker.service_cli import render_status
        text = render_status(st)
        line = next(x for x in text.splitlines() if x.strip().startswith(EVIL))
        assert "rejected: Device" in line
    finally:
        c.close()
        evil.close()
        for p in procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)
