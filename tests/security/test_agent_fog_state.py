"""Finding 5: one unsigned retained FogState(online=false) parked every device.

Now fog STATE counts only sealed by the pinned fog key: online for an epoch >= the last
seen, offline only for the current epoch. Unsigned or stale ones are counted and ignored.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from runtime import codec
from runtime.messages import DeviceBirth, FogState

from _agent_harness import FogSide, kill, spawn_agent, wait_status

pytestmark = pytest.mark.integration


def _publish(fog: FogSide, payload: bytes) -> None:
    assert fog.client.publish(fog.topics.fog_state(), payload, retain=True).wait(5)


def _still_advertising(fog: FogSide, data: Path, device: str) -> None:
    fog.seen.clear()
    while not fog.events.empty():
        fog.events.get_nowait()
    fog.wait_leaf(device, "STATE", timeout=5)
    assert wait_status(data, lambda s: True)["phase"] == "online"


def test_forged_offline_fog_state_parks_no_device(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fog = FogSide(mosquitto)
    data = tmp_path / "dev-s"
    old_will = fog.fog.fog_state(online=False, epoch=2)   # captured from the fog's previous run
    old_online = fog.fog.fog_state(online=True, epoch=2)
    fog.online(epoch=3)
    proc = spawn_agent(mosquitto, "dev-s", data, "--state-interval", "1", fog=fog.fog)
    try:
        birth: DeviceBirth = fog.wait_leaf("dev-s", "BIRTH", timeout=15)

        # the attack: an unsigned retained offline state for the current fog epoch
        _publish(fog, codec.encode(FogState("fog-test", "default", False, 3, fog.fog.public_key, time.time())))
        wait_status(data, lambda s: s["counters"].get("rejected fog state: unsigned", 0) >= 1, timeout=5)
        _still_advertising(fog, data, "dev-s")
        # replays of genuine but old states: the previous run's Will and an older online state
        _publish(fog, old_will)
        _publish(fog, old_online)
        wait_status(data, lambda s: s["counters"].get("stale fog state", 0) >= 2, timeout=5)
        _still_advertising(fog, data, "dev-s")
        with pytest.raises(AssertionError):  # the stale online state triggered no rebirth either
            fog.wait_leaf("dev-s", "BIRTH", timeout=0.5, cond=lambda m: m.seq > birth.seq)

        # the legitimate path: the fog's own sealed Will for the current epoch parks the device ...
        fog.online(epoch=3, online=False)
        wait_status(data, lambda s: s["phase"] == "waiting for fog", timeout=5)
        time.sleep(0.3)  # a STATE already in flight may still arrive; none after that
        fog.seen.clear()
        while not fog.events.empty():
            fog.events.get_nowait()
        with pytest.raises(AssertionError):
            fog.wait_leaf("dev-s", "STATE", timeout=2.5)
        # ... and its return (new epoch) brings the device back
        fog.online(epoch=4)
        fog.wait_leaf("dev-s", "BIRTH", timeout=5, cond=lambda m: m.seq > birth.seq)
        assert wait_status(data, lambda s: s["phase"] == "online")["fog_epoch"] == 4
    finally:
        kill(proc)
        fog.close()
    assert fog.unverified == 0

    # the highest fog epoch survives a restart: the old online state is refused by a fresh process too
    fog = FogSide(mosquitto, fog=fog.fog)
    _publish(fog, old_online)
    proc = spawn_agent(mosquitto, "dev-s", data, "--state-interval", "1", fog=fog.fog)
    try:
        wait_status(data, lambda s: s.get("pid") == proc.pid and s["counters"].get("stale fog state", 0) >= 1,
                    timeout=15)
        assert wait_status(data, lambda s: True)["births"] == 0
    finally:
        kill(proc)
        fog.close()
