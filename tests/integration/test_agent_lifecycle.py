"""Agent as a real process: key, birth after fog STATE, periodic state, rebirth, death on kill -9."""
from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from runtime.messages import DeviceBirth, DeviceDeath, DeviceState

from _agent_harness import REPO, FogSide, kill, spawn_agent, wait_status

pytestmark = pytest.mark.integration


@pytest.fixture
def fog(mosquitto) -> Iterator[FogSide]:  # type: ignore[no-untyped-def]
    side = FogSide(mosquitto)
    yield side
    side.close()


def test_key_command_prints_stable_key(tmp_path: Path) -> None:
    out1 = subprocess.run([sys.executable, "-m", "edge_agent", "key", "--data-dir", str(tmp_path)],
                          cwd=REPO, capture_output=True, text=True, timeout=30, check=True).stdout
    out2 = subprocess.run([sys.executable, "-m", "edge_agent", "key", "--data-dir", str(tmp_path), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=30, check=True).stdout
    assert "fingerprint:" in out1
    assert out1.split()[2] in out2
    assert (tmp_path / "agent.key").stat().st_mode & 0o077 == 0


def test_birth_state_rebirth_death(mosquitto, fog: FogSide, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    data = tmp_path / "a"
    proc = spawn_agent(mosquitto, "dev-a", data, "--state-interval", "1", "--labels", "zone=z1",
                       "--taints", "battery=true:PreferNoSchedule", fog=fog.fog)
    try:
        # no fog STATE yet: the agent connects but must not publish its birth
        with pytest.raises(AssertionError):
            fog.wait_leaf("dev-a", "BIRTH", timeout=1.5)
        fog.online(epoch=7)
        birth: DeviceBirth = fog.wait_leaf("dev-a", "BIRTH")
        assert birth.site == "default" and birth.labels["zone"] == "z1" and birth.state_interval_s == 1.0
        assert birth.taints[0].key == "battery" and birth.taints[0].effect == "PreferNoSchedule"
        assert not birth.simulated and birth.flops > 0 and birth.memory_bytes > 0 and birth.cpu_count >= 1
        assert "CPUExecutionProvider" in birth.providers
        first: DeviceState = fog.wait_leaf("dev-a", "STATE")
        t0 = time.monotonic()
        second: DeviceState = fog.wait_leaf("dev-a", "STATE", timeout=5)
        assert 0.5 < time.monotonic() - t0 < 3.0, "periodic state every ~1 s"
        assert second.epoch == first.epoch == birth.epoch and second.seq > first.seq > birth.seq
        assert second.free_memory_bytes > 0 and second.partitions == ()

        # rebirth on request (broadcast, signed by the fog)
        fog.client.publish(fog.topics.rebirth(), fog.fog.seal(fog.fog.rebirth())).wait(5)
        again: DeviceBirth = fog.wait_leaf("dev-a", "BIRTH", timeout=5)
        assert again.epoch == birth.epoch and again.seq > second.seq

        # kill -9: the broker publishes the Will with this connection's epoch at once
        fog.wait_leaf("dev-a", "STATE", timeout=5)
        proc.kill()
        t_kill = time.monotonic()
        death: DeviceDeath = fog.wait_leaf("dev-a", "DEATH", timeout=3)
        assert time.monotonic() - t_kill < 1.0
        assert death.epoch == birth.epoch and death.device_id == "dev-a"
    finally:
        kill(proc)

    # restart: a new connection epoch, birth again
    proc = spawn_agent(mosquitto, "dev-a", data, "--state-interval", "1", fog=fog.fog)
    try:
        reborn: DeviceBirth = fog.wait_leaf("dev-a", "BIRTH", timeout=10)
        assert reborn.epoch > birth.epoch and reborn.public_key == birth.public_key
        # fog goes offline (its sealed Will for the current epoch 7) and the device stops advertising,
        # then the fog comes back with a new epoch: the device re-announces itself
        fog.online(epoch=7, online=False)
        wait_status(data, lambda s: s.get("phase") == "waiting for fog", timeout=5)
        fog.online(epoch=9)
        fog.wait_leaf("dev-a", "BIRTH", timeout=5, cond=lambda m: m.epoch == reborn.epoch and m.seq > reborn.seq)
        # SIGTERM: orderly stop says DEATH itself (a clean disconnect suppresses the Will)
        proc.terminate()
        death2: DeviceDeath = fog.wait_leaf("dev-a", "DEATH", timeout=5)
        assert death2.epoch == reborn.epoch
        assert proc.wait(timeout=5) == 0
    finally:
        kill(proc)
    assert fog.unverified == 0


def test_broker_restart_reconnects_with_a_new_epoch(tmp_path: Path) -> None:
    """paho reconnects by itself; the agent adopts the Will epoch it installed for that connection."""
    from runtime.broker import BrokerConfig, MosquittoBroker

    cfg = BrokerConfig(data_dir=tmp_path / "mq", persistence=False)
    broker = MosquittoBroker(cfg).start()
    port = broker.port
    fog = FogSide(broker)
    fog.online()
    proc = spawn_agent(broker, "dev-r", tmp_path / "r", "--state-interval", "1", fog=fog.fog)
    try:
        first: DeviceBirth = fog.wait_leaf("dev-r", "BIRTH", timeout=10)
        fog.close()
        broker.kill()
        broker = MosquittoBroker(BrokerConfig(data_dir=tmp_path / "mq2", port=port, persistence=False)).start()
        fog = FogSide(broker, fog=fog.fog)  # same fog identity: the key the agent pinned
        fog.online(epoch=2)  # the restarted fog re-announces itself (retained)
        second: DeviceBirth = fog.wait_leaf("dev-r", "BIRTH", timeout=15)
        assert second.epoch == first.epoch + 1
        # a new fog identity is refused: the agent pinned the operator-given key
        impostor = FogSide(broker, fog_id="fog-test")
        impostor.online(epoch=3)
        with pytest.raises(AssertionError):
            fog.wait_leaf("dev-r", "BIRTH", timeout=1.0)
        impostor.online(epoch=4, online=False)  # ignored too: it cannot silence the device
        impostor.close()
        fog.seen.clear()
        fog.wait_leaf("dev-r", "STATE", timeout=3)
        fog.online(epoch=5)
        fog.wait_leaf("dev-r", "BIRTH", timeout=5, cond=lambda m: m.epoch == second.epoch)
        proc.kill()
        death: DeviceDeath = fog.wait_leaf("dev-r", "DEATH", timeout=3)
        assert death.epoch == second.epoch
    finally:
        kill(proc)
        fog.close()
        broker.stop()
