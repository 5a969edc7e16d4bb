"""Finding 10: one 16 MiB message of empty msgpack arrays decoded to ~1.2 GB before any signature check.

Before: agent 81 MB -> 1.32 GB, fog 75 MB -> 1.33 GB: an OOM kill on a Pi. Now every frame is
decoded under an object budget (``runtime.codec``: envelopes and relay frames get 64 objects,
and metadata longer than the budget is walked, building nothing, before it is parsed).

The bombs are built by hand in the codec's frame format (``b"FGL\\x01"``, u32 metadata length,
msgpack metadata): an array32 of ~16.7 million empty arrays (``0x90``) or empty maps (``0x80``).
The broker's ``message_size_limit`` (24 MiB, so that a deploy with an uploaded model fits) lets
a 16 MiB bomb through, so the decoders are what must hold. Each target is a real process whose
peak RSS (``VmHWM`` in /proc/PID/status) is read before and after: the agent (ACT from an
enrolled device; CMD on a plain loopback broker, since on the secure site only the fog may write
it) and the fog with its verify workers (CTL and INFER from an operator, results from a device,
releases from a coordinator, a device's own adverts).
"""
from __future__ import annotations

import struct
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from waiting import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from runtime import codec
from runtime.broker import _run_dir, find_mosquitto
from runtime.credentials import Credentials, load_credentials
from runtime.mqtt import MqttClient, TlsConfig
from runtime.topics import Topics
from simulations.local_site import LocalSite

from _agent_harness import REPO, FogSide, kill, spawn_agent, wait_status

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240),
              pytest.mark.skipif(find_mosquitto() is None, reason="mosquitto not installed")]

T = Topics("default")
MiB = 1024 * 1024
BOMB = 16 * MiB                 # the agent's and the codec's default limit, to the byte
GROWTH_LIMIT_MB = 200           # before the fix: +1,200 MB and more per bomb
DEV, EVIL = "dev-b", "evil"


def bomb(size: int = BOMB, item: int = 0x90) -> bytes:
    """A frame of exactly ``size`` bytes whose metadata is one array32 of empty arrays (or maps)."""
    meta_len = size - 8
    count = meta_len - 5
    meta = b"\xdd" + count.to_bytes(4, "big") + bytes([item]) * count
    frame = codec.MAGIC + struct.pack("<I", meta_len) + meta
    assert len(frame) == size
    return frame


def hwm_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {pid}")


def children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,comm=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(ln.split()[0]) for ln in out.splitlines() if "python" in ln]


def connect(name: str, port: int, tls: TlsConfig | None) -> MqttClient:
    c = MqttClient(name, "127.0.0.1", port, tls=tls, max_queued=100)
    c.start()
    assert c.wait_connected(10), c.last_error
    return c


@dataclass
class Site:
    site: LocalSite
    agent: subprocess.Popen[bytes]
    dev_data: Path
    evil_data: Path

    def creds(self, name: str) -> Credentials:
        return load_credentials(self.site.credentials(name))

    def status(self) -> dict[str, Any]:
        from fog_broker.client import FogClient
        with FogClient("127.0.0.1", self.site.port, credentials=self.site.credentials("watch")) as c:
            return c.status()  # type: ignore[no-any-return]

    def infer(self) -> np.ndarray:
        with self.site.client() as c:
            return np.asarray(c.infer("w", {"x": np.ones((1, 64), np.float32)}, timeout=10)["logits"])


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    from edge_agent.enrol import enrol_dirs
    from fog_broker.client import FogClient
    root = tmp_path_factory.mktemp("bombs")
    site = LocalSite(root / "fog").start()
    proc = None
    try:
        for name, role in (("watch", "operator"), ("coord-b", "coordinator")):
            site.issue(name, role)
            FogClient("127.0.0.1", site.port, credentials=site.credentials(name)).close()  # ACL loaded
        with open(root / f"{DEV}.log", "wb") as log:
            proc = subprocess.Popen(site.agent_argv(DEV, root / DEV, "--threads", "1"), cwd=REPO, stdout=log,
                                    stderr=subprocess.STDOUT)
        wait_status(root / DEV, lambda s: s.get("phase") == "online", timeout=40)
        with site.client() as c:
            c.deploy({"name": "w", "model": "zoo:mlp", "source": DEV, "sink": DEV})
            c.wait_running("w", 40)
        enrol_dirs(site.token(), [(EVIL, root / EVIL)], "127.0.0.1", int(site.enroll.rsplit(":", 1)[1]),
                   timeout_s=30)
        s = Site(site, proc, root / DEV, root / EVIL)
        s.infer()  # warm: onnxruntime loaded in the agent, the partition built in the fog
        yield s
    finally:
        if proc is not None:
            kill(proc)
        site.stop()


def test_the_broker_lets_a_16_mib_bomb_through(env: Site) -> None:
    """Why the decoders must hold: the size limit is above the bomb (and above any legitimate frame)."""
    conf = (_run_dir(env.site.data_dir / "mqtt") / "mosquitto.conf").read_text()
    limit = int(next(ln.split()[1] for ln in conf.splitlines() if ln.startswith("message_size_limit ")))
    assert BOMB < limit <= 32 * MiB
    with pytest.raises(codec.DecodeError, match="object budget"):
        codec.decode(bomb())
    with pytest.raises(codec.DecodeError, match="object budget"):
        codec.decode(bomb(item=0x80))


def test_bombs_to_an_agent_cost_it_no_memory(env: Site) -> None:
    from edge_agent.credentials import tls_config
    before_ctr = wait_status(env.dev_data, lambda s: "counters" in s)["counters"]
    pid = env.agent.pid
    before = hwm_mb(pid)
    e = connect(EVIL, env.site.port, tls_config(env.evil_data, "fog-default"))
    try:
        for item in (0x90, 0x80):
            assert e.publish(T.activation(DEV, EVIL), bomb(item=item), qos=1).wait(60)  # devices may write ACT
            assert e.publish(T.device(DEV, "CMD"), bomb(item=item), qos=1).wait(60)  # the ACL drops these
    finally:
        e.stop()
    st = wait_status(env.dev_data, lambda s: s["counters"].get("rejected activation: malformed", 0)
                     >= before_ctr.get("rejected activation: malformed", 0) + 2, timeout=30)
    grown = hwm_mb(pid) - before
    assert grown < GROWTH_LIMIT_MB, f"agent peak RSS grew by {grown:.0f} MB"
    assert st["counters"].get("rejected: malformed", 0) == before_ctr.get("rejected: malformed", 0)  # no CMD got in
    assert st["phase"] == "online" and env.infer().shape == (1, 10)  # and it still serves


def test_bombs_to_the_fog_cost_it_no_memory(env: Site) -> None:
    from edge_agent.credentials import tls_config
    fog_pid = env.site.proc.pid  # type: ignore[union-attr]
    pids = [fog_pid, *children(fog_pid)]  # the verify workers decode adverts
    assert len(pids) >= 2
    before = {p: hwm_mb(p) for p in pids}
    base = env.status()["counters"]
    watch, coord = env.creds("watch"), env.creds("coord-b")
    op = connect("watch", env.site.port, watch.tls_for("fog-default"))
    try:
        for item in (0x90, 0x80):
            assert op.publish(T.control("watch"), bomb(item=item), qos=1).wait(60)
            assert op.publish(T.infer("watch"), bomb(item=item), qos=1).wait(60)
    finally:
        op.stop()
    co = connect("coord-b", env.site.port, coord.tls_for("fog-default"))
    try:
        assert co.publish(T.release("coord-b"), bomb(), qos=1).wait(60)
    finally:
        co.stop()
    e = connect(EVIL, env.site.port, tls_config(env.evil_data, "fog-default"))
    try:
        assert e.publish(T.result("fog-default", EVIL), bomb(), qos=1).wait(60)  # devices answer the fog here
        for leaf in ("BIRTH", "STATE", "DEATH"):  # its own adverts: 16 MiB, and bombs under the 64 KiB advert cap
            assert e.publish(T.device(EVIL, leaf), bomb(), qos=1).wait(60)
            assert e.publish(T.device(EVIL, leaf), bomb(60 * 1024, 0x80), qos=1).wait(10)
    finally:
        e.stop()

    def delta(st: dict[str, Any], key: str) -> int:
        return int(st["counters"].get(key, 0)) - int(base.get(key, 0))
    def refused() -> dict[str, Any] | None:
        s = env.status()
        return s if delta(s, "rejected:malformed") >= 6 and delta(s, "verifier.malformed") >= 3 else None
    try:
        st = wait_for(refused, 30, "the fog refused every bomb")
    except AssertionError:
        print({k: v for k, v in env.status()["counters"].items() if base.get(k) != v})
        raise
    grown = {p: hwm_mb(p) - before[p] for p in pids}
    assert all(g < GROWTH_LIMIT_MB for g in grown.values()), f"peak RSS growth by pid (MB): {grown}"
    assert st["counters"].get("internal_errors", 0) == base.get("internal_errors", 0)
    assert env.infer().shape == (1, 10)  # the fog still routes


def test_a_bomb_on_an_agent_s_command_topics_costs_it_no_memory(mosquitto: Any, tmp_path: Path) -> None:
    """CMD, REBIRTH and fog STATE reach an agent only from the fog on the secure site; on a plain
    broker anyone can write them, so the agent's own decoder is what holds."""
    fog = FogSide(mosquitto)
    fog.online(epoch=1)
    data = tmp_path / "dev-c"
    proc = spawn_agent(mosquitto, "dev-c", data, "--state-interval", "1", fog=fog.fog)
    try:
        fog.wait_leaf("dev-c", "BIRTH", timeout=30)
        st = wait_status(data, lambda s: s.get("phase") == "online" and s.get("pid") == proc.pid, timeout=10)
        before_ctr = st["counters"]
        before = hwm_mb(proc.pid)
        for item in (0x90, 0x80):
            fog.raw("dev-c", bomb(item=item))
            assert fog.client.publish(fog.topics.rebirth(), bomb(item=item), qos=1).wait(60)
            assert fog.client.publish(fog.topics.fog_state(), bomb(item=item), qos=1).wait(60)

        def refused(s: dict[str, Any]) -> bool:
            c = s["counters"]
            return bool(c.get("rejected: malformed", 0) >= before_ctr.get("rejected: malformed", 0) + 4
                    and c.get("rejected fog state: unsigned", 0) >= before_ctr.get("rejected fog state: unsigned",
                                                                                   0) + 2)
        st = wait_status(data, refused, timeout=30)
        grown = hwm_mb(proc.pid) - before
        assert grown < GROWTH_LIMIT_MB, f"agent peak RSS grew by {grown:.0f} MB"
        assert st["phase"] == "online"
        first = fog.wait_leaf("dev-c", "STATE", timeout=5)  # still advertising
        fog.wait_leaf("dev-c", "STATE", timeout=5, cond=lambda m: m.seq > first.seq)
    finally:
        kill(proc)
        fog.close()
