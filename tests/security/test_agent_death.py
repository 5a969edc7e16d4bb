"""Finding 6 (device side): the Will and the orderly-stop DEATH are envelopes sealed by the device.

A forged DEATH (plain, or sealed by another key) does not verify against the device's key;
the agent's own deaths do, on a crash (the Will) and on SIGTERM.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from runtime import codec
from runtime.errors import RemoteViolation
from runtime.messages import DeviceBirth, DeviceDeath, Envelope
from runtime.security import Identity, Signer, TrustStore, Verifier

from _agent_harness import FogSide, kill, run_agent_cli, spawn_agent

pytestmark = pytest.mark.integration


def _open_death(payload: bytes, device_key: bytes, device: str) -> DeviceDeath:
    """What the fog does with a DEATH: the envelope must be sealed by the device's pinned key."""
    env = codec.decode(payload)
    if not isinstance(env, Envelope):
        raise RemoteViolation("DEATH is not an envelope")
    v = Verifier(TrustStore({device: device_key}))
    v.verify_signature(env)
    msg = codec.decode(env.payload)
    assert isinstance(msg, DeviceDeath) and msg.device_id == env.sender == device
    assert msg.epoch == env.epoch
    return msg


def test_deaths_are_sealed_by_the_device(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fog = FogSide(mosquitto)
    fog.online(epoch=1)
    data = tmp_path / "dev-d"
    key = run_agent_cli("key", "--id", "dev-d", "--data-dir", str(data), "--json", timeout=30)
    device_key = bytes.fromhex(json.loads(key.stdout)["public_key"])

    # forged deaths an attacker on the LAN can make: plain, or sealed by its own key under the device's name
    for forged in (codec.encode(DeviceDeath("dev-d", 1)),
                   Signer(Identity.generate("dev-d"), 1).seal_bytes(DeviceDeath("dev-d", 1), time.time())):
        with pytest.raises(RemoteViolation):
            _open_death(forged, device_key, "dev-d")

    proc = spawn_agent(mosquitto, "dev-d", data, "--state-interval", "1", fog=fog.fog)
    try:
        birth: DeviceBirth = fog.wait_leaf("dev-d", "BIRTH", timeout=15)
        assert birth.public_key == device_key
        first = fog.wait_leaf("dev-d", "STATE", timeout=5)
        fog.wait_leaf("dev-d", "STATE", timeout=5, cond=lambda m: m.seq > first.seq)  # ~1 s later
        t_kill = time.time()
        proc.kill()  # the broker publishes the Will
        will: DeviceDeath = fog.wait_leaf("dev-d", "DEATH", timeout=5)
        assert will.epoch == birth.epoch
        sealed = _open_death(fog.raw_deaths[-1], device_key, "dev-d")
        assert sealed.epoch == birth.epoch
        assert codec.decode(fog.raw_deaths[-1]).timestamp < t_kill - 0.5  # sealed when the Will was set
    finally:
        kill(proc)

    proc = spawn_agent(mosquitto, "dev-d", data, "--state-interval", "1", fog=fog.fog)
    try:
        reborn: DeviceBirth = fog.wait_leaf("dev-d", "BIRTH", timeout=15)
        proc.terminate()  # orderly stop: the agent publishes the DEATH itself
        death: DeviceDeath = fog.wait_leaf("dev-d", "DEATH", timeout=5)
        assert death.epoch == reborn.epoch > birth.epoch
        assert _open_death(fog.raw_deaths[-1], device_key, "dev-d").epoch == reborn.epoch
        assert proc.wait(timeout=5) == 0
    finally:
        kill(proc)
        fog.close()
    assert fog.unverified == 0
