"""Findings 5 and 6 (fog side): the fog's retained STATE is the fog's alone; deaths cannot lock a device out.

Before: one unsigned retained ``FogState(online=false)`` parked every device until the fog
restarted (the fog never re-asserted its state), and an unsigned ``DeviceDeath`` with epoch
2^62 locked a device out (the registry raised the epoch from a death). Now two layers:

* the broker's ACL lets only the fog write ``fog/STATE`` and only a device its own DEATH
  (the secure site of the README, ``fogline broker``);
* behind it, the fog re-publishes its sealed state whenever anything else appears there, and
  applies a death only when it is sealed by the device for its *current* epoch (never raising
  it). That layer is shown on a site run with ``--insecure`` (plain MQTT on loopback), where
  anyone can publish anything.

The agent side of both findings is in test_agent_fog_state.py and test_agent_death.py.
"""
from __future__ import annotations

import queue
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from waiting import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from runtime import codec
from runtime.broker import find_mosquitto
from runtime.credentials import load_credentials
from runtime.messages import DeviceDeath, Envelope, FogState
from runtime.mqtt import Inbound, MqttClient, TlsConfig
from runtime.security import Identity, Signer, TrustStore, Verifier
from runtime.topics import Topics
from simulations.local_site import LocalSite

from _agent_harness import REPO, kill, wait_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

T = Topics("default")


def _status(site: LocalSite) -> dict[str, Any]:
    with site.client() as c:
        return c.status()  # type: ignore[no-any-return]


def _device(site: LocalSite, dev: str) -> dict[str, Any] | None:
    return next((d for d in _status(site)["devices"] if d["id"] == dev), None)


def _row(site: LocalSite, dev: str) -> dict[str, Any]:
    row = _device(site, dev)
    assert row is not None, f"{dev} is not in the fog's registry"
    return row


def _retained_state(site: LocalSite, tls: TlsConfig | None, name: str) -> FogState:
    """A fresh subscriber's view of the retained fog/STATE, checked against the pinned fog key."""
    got: queue.Queue[Inbound] = queue.Queue()
    c = MqttClient(name, "127.0.0.1", site.port, tls=tls)
    c.subscribe(T.fog_state(), got.put)
    c.start()
    try:
        assert c.wait_connected(10), c.last_error
        m = got.get(timeout=10)
    finally:
        c.stop()
    assert m.retain
    env = codec.decode(m.payload)
    assert isinstance(env, Envelope)
    fs = Verifier(TrustStore({"fog-default": bytes.fromhex(site.ready["public_key"])})).verify_only(env)
    assert isinstance(fs, FogState)
    return fs


def _forged_states(epoch: int) -> list[bytes]:
    """Offline states an attacker can make: unsigned, and sealed by a key of its own under the fog's name."""
    offline = FogState("fog-default", "default", False, epoch, b"", time.time())
    return [codec.encode(offline), Signer(Identity.generate("fog-default"), epoch).seal_bytes(offline, time.time())]


def _forged_deaths(dev: str) -> list[bytes]:
    return [codec.encode(DeviceDeath(dev, 2 ** 62)),
            Signer(Identity.generate(dev), 2 ** 62).seal_bytes(DeviceDeath(dev, 2 ** 62), time.time())]


def _spawn(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)


# ---------------------------------------------------------------- the secure site: the ACL layer


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSite]:
    s = LocalSite(tmp_path_factory.mktemp("auth") / "fog", args=["--state-interval", "1"]).start()
    try:
        yield s
    finally:
        s.stop()


def test_no_identity_but_the_fog_writes_fog_state_or_another_device_s_death(site: LocalSite,
                                                                             tmp_path: Path) -> None:
    from edge_agent.credentials import tls_config
    from edge_agent.enrol import enrol_dirs
    data = tmp_path / "dev-a"
    proc = _spawn(site.agent_argv("dev-a", data, "--state-interval", "1", "--threads", "1"), tmp_path / "dev-a.log")
    try:
        wait_status(data, lambda s: s.get("phase") == "online", timeout=30)
        row = wait_for(lambda: (d := _device(site, "dev-a")) is not None and d["alive"] and d, 20, "dev-a alive")
        # every kind of identity of the site tries: a device, an operator, a coordinator, an app
        enrol_dirs(site.token(), [("evil", tmp_path / "evil")], "127.0.0.1", int(site.enroll.rsplit(":", 1)[1]),
                   timeout_s=30)
        carriers: list[tuple[str, TlsConfig]] = [("evil", tls_config(tmp_path / "evil", "fog-default"))]
        for name, role in (("op-x", "operator"), ("coord-x", "coordinator"), ("app-x", "app")):
            site.issue(name, role)
            from fog_broker.client import FogClient
            FogClient("127.0.0.1", site.port, credentials=site.credentials(name)).close()  # ACL loaded
            cr = load_credentials(site.credentials(name))
            carriers.append((name, cr.tls_for(cr.fog.fog_id)))
        for name, tls in carriers:
            c = MqttClient(name, "127.0.0.1", site.port, tls=tls)
            c.start()
            try:
                assert c.wait_connected(10), c.last_error
                for payload in _forged_states(site.ready["epoch"]):
                    c.publish(T.fog_state(), payload, qos=1, retain=True).wait(5)
                for payload in _forged_deaths("dev-a"):
                    c.publish(T.device("dev-a", "DEATH"), payload, qos=1).wait(5)
            finally:
                c.stop()
        time.sleep(1.0)
        opx = load_credentials(site.credentials("op-x"))
        fs = _retained_state(site, opx.tls_for("fog-default"), "op-x")
        assert fs.online and fs.epoch == site.ready["epoch"]
        st = _status(site)
        assert st["counters"].get("fog_state_reasserted", 0) == 0  # nothing got as far as the fog
        dev = next(d for d in st["devices"] if d["id"] == "dev-a")
        assert dev["alive"] and dev["epoch"] == row["epoch"]
        agent = wait_status(data, lambda s: True)
        assert agent["phase"] == "online"
        assert not any(k.startswith("rejected fog state") for k in agent["counters"])  # none reached it
        # the legitimate death: the device's own Will, for its current epoch
        proc.kill()
        wait_for(lambda: not (_device(site, "dev-a") or {"alive": True})["alive"], 30, "dev-a lost after kill -9")
    finally:
        kill(proc)


# ---------------------------------------------------------------- --insecure: the fog's own layer


@pytest.fixture(scope="module")
def open_site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSite]:
    """``fogline broker --insecure``: plain MQTT on loopback, no ACL, so every forgery reaches the fog."""
    s = LocalSite(tmp_path_factory.mktemp("auth-open") / "fog", insecure=True, args=["--state-interval", "1"]).start()
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def open_agent(open_site: LocalSite, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Identity]]:
    from edge_agent.agent import load_identity
    data = tmp_path_factory.mktemp("open-dev") / "dev-i"
    ident = load_identity(data, "dev-i")
    open_site.add_device_key("dev-i", ident.public_key_bytes)  # `fogline devices add dev-i --key HEX`
    proc = _spawn([sys.executable, "-m", "edge_agent", "--broker", open_site.mqtt, "--id", "dev-i", "--data-dir",
                   str(data), "--insecure", "--fog-key", open_site.ready["public_key"], "--state-interval", "1",
                   "--keepalive", "2", "--threads", "1"], data.parent / "dev-i.log")
    try:
        wait_status(data, lambda s: s.get("phase") == "online", timeout=30)
        wait_for(lambda: (d := _device(open_site, "dev-i")) is not None and d["alive"], 20, "dev-i alive")
        yield data, ident
    finally:
        kill(proc)


def test_the_fog_reasserts_its_state_over_anything_else(open_site: LocalSite,
                                                        open_agent: tuple[Path, Identity]) -> None:
    data, _ = open_agent
    attacker = MqttClient(f"anon-{time.time_ns()}", "127.0.0.1", open_site.port)
    attacker.start()
    try:
        assert attacker.wait_connected(10)
        for payload in _forged_states(open_site.ready["epoch"]):
            assert attacker.publish(T.fog_state(), payload, qos=1, retain=True).wait(5)
    finally:
        attacker.stop()
    wait_for(lambda: _status(open_site)["counters"].get("fog_state_reasserted", 0) >= 2, 20, "re-assertion")
    fs = _retained_state(open_site, None, f"obs-{time.time_ns()}")
    assert fs.online and fs.epoch == open_site.ready["epoch"]
    agent = wait_status(data, lambda s: s["counters"].get("rejected fog state: unsigned", 0) >= 1
                        and s["counters"].get("rejected fog state: bad signature", 0) >= 1, timeout=10)
    states = agent["states"]
    agent = wait_status(data, lambda s: s["states"] > states + 1, timeout=10)  # never parked: still advertising
    assert agent["phase"] == "online"


def test_a_death_counts_only_for_the_current_epoch_and_never_raises_it(open_site: LocalSite,
                                                                       open_agent: tuple[Path, Identity]) -> None:
    _, ident = open_agent
    row = _device(open_site, "dev-i")
    assert row is not None and row["alive"]
    epoch = row["epoch"]
    attacker = MqttClient(f"anon-{time.time_ns()}", "127.0.0.1", open_site.port)
    attacker.start()
    try:
        assert attacker.wait_connected(10)
        # sealed by the device's real key: its next connection's Will (epoch + 1) and a far future one
        for e in (epoch + 1, 2 ** 62):
            death = Signer(ident, e).seal_bytes(DeviceDeath("dev-i", e), time.time())
            assert attacker.publish(T.device("dev-i", "DEATH"), death, qos=1).wait(5)
        for payload in _forged_deaths("dev-i"):  # unsigned, and sealed by another key
            assert attacker.publish(T.device("dev-i", "DEATH"), payload, qos=1).wait(5)
        time.sleep(1.5)
        row = _device(open_site, "dev-i")
        assert row is not None and row["alive"] and row["epoch"] == epoch
        assert row["last_seen_s"] is not None and row["last_seen_s"] < 5  # its states are still taken
        # the legitimate death: sealed by the device for its current epoch
        death = Signer(ident, epoch).seal_bytes(DeviceDeath("dev-i", epoch), time.time())
        assert attacker.publish(T.device("dev-i", "DEATH"), death, qos=1).wait(5)
        wait_for(lambda: not _row(open_site, "dev-i")["alive"], 10, "dev-i dead after its current-epoch death")
    finally:
        attacker.stop()
    # the device is still there: the fog asks it for a birth and it is back, with an epoch it chose
    wait_for(lambda: _row(open_site, "dev-i")["alive"], 20, "dev-i back")
    assert _row(open_site, "dev-i")["epoch"] < 2 ** 62
