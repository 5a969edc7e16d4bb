"""Finding 4: agents pinned the fog key from an unsigned retained FogState (trust on first use).

Now the key comes only from enrolment (fog.json) or the operator (``--fog-key``); without
either the agent refuses to start, and a forged retained state captures nothing.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from edge_agent.testing import FogSigner
from runtime import codec
from runtime.messages import DeviceBirth, FogState

from _agent_harness import FogSide, error_lines, kill, run_agent_cli, spawn_agent, wait_status

pytestmark = pytest.mark.integration


@pytest.fixture
def fog(mosquitto) -> Iterator[FogSide]:  # type: ignore[no-untyped-def]
    side = FogSide(mosquitto)
    yield side
    side.close()


def _forge(fog: FogSide, attacker: FogSigner, *, sealed: bool) -> None:
    """The attacker's retained fog STATE naming its own key: plain (the old attack) or sealed by it."""
    if sealed:
        payload = attacker.fog_state(online=True, epoch=99)
    else:
        payload = codec.encode(FogState(fog.fog.fog_id, "default", True, 99, attacker.public_key, time.time()))
    assert fog.client.publish(fog.topics.fog_state(), payload, retain=True).wait(5)


def test_without_enrolment_or_fog_key_the_agent_refuses_to_start(mosquitto, fog: FogSide,  # type: ignore[no-untyped-def]
                                                                  tmp_path: Path) -> None:
    _forge(fog, FogSigner("fog-test"), sealed=False)  # waiting on the broker for a fresh device
    data = tmp_path / "fresh"
    out = run_agent_cli("--broker", mosquitto.address, "--id", "fresh", "--data-dir", str(data), timeout=30)
    assert out.returncode == 2
    lines = error_lines(out.stderr)
    assert len(lines) == 1 and "not enrolled" in lines[0] and "--token" in lines[0], out.stderr
    out = run_agent_cli("--broker", mosquitto.address, "--id", "fresh", "--data-dir", str(data), "--insecure",
                        timeout=30)
    assert out.returncode == 2 and "--insecure needs --fog-key" in out.stderr
    assert not (data / "fog.json").exists() and not (data / "fog.pub").exists()


@pytest.mark.parametrize("sealed", [False, True], ids=["unsigned", "sealed-by-attacker"])
def test_forged_retained_fog_state_captures_no_device(mosquitto, fog: FogSide, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                      sealed: bool) -> None:
    attacker = FogSigner("fog-test")  # same name as the real fog, another key
    _forge(fog, attacker, sealed=sealed)
    data = tmp_path / "dev-k"
    proc = spawn_agent(mosquitto, "dev-k", data, "--state-interval", "1", fog=fog.fog)
    try:
        st = wait_status(data, lambda s: any(k.startswith("rejected fog state") for k in s.get("counters", {})),
                         timeout=15)
        assert st["phase"] == "waiting for fog" and st["births"] == 0
        with pytest.raises(AssertionError):
            fog.wait_leaf("dev-k", "BIRTH", timeout=1.0)
        # commands sealed by the attacker's key are refused too
        fog.raw("dev-k", attacker.seal(attacker.rebirth()))
        wait_status(data, lambda s: s["verifier"]["rejected"].get("bad signature", 0) >= 1, timeout=5)
        # the legitimate fog still gets the device
        fog.online(epoch=3)
        birth: DeviceBirth = fog.wait_leaf("dev-k", "BIRTH", timeout=10)
        assert birth.device_id == "dev-k"
        # the attacker's retained state came again after the real one: still ignored, still online
        _forge(fog, attacker, sealed=sealed)
        fog.seen.clear()
        fog.wait_leaf("dev-k", "STATE", timeout=5)
        assert wait_status(data, lambda s: s["phase"] == "online")["fog_epoch"] == 3
    finally:
        kill(proc)
    assert not (data / "fog.json").exists() and not (data / "fog.pub").exists()  # nothing learned
