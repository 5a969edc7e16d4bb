"""Finding 15 (device side): a command replayed 29 s after an agent restart was accepted.

The agent persists its command replay window in the data dir, so a captured command
replayed after a restart (well inside the 30 s timestamp window) is refused, while new
commands from the fog are accepted.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from edge_agent.testing import tiny_chain

from _agent_harness import FogSide, kill, spawn_agent, wait_status

pytestmark = pytest.mark.integration

CHAIN = tiny_chain(seed=3)


def test_command_replayed_after_restart_is_refused(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fog = FogSide(mosquitto)
    fog.online(epoch=1)
    data = tmp_path / "dev-p"
    proc = spawn_agent(mosquitto, "dev-p", data, "--state-interval", "1", fog=fog.fog)
    try:
        fog.wait_leaf("dev-p", "BIRTH", timeout=15)
        captured = fog.fog.seal(fog.fog.deploy("dep-1", CHAIN.parts[0], memory_bytes=1_000_000))
        sealed_at = time.time()
        fog.raw("dev-p", captured)
        assert fog.wait_leaf("dev-p", "ACK", timeout=15, cond=lambda m: m.command_id == "dep-1").ok
    finally:
        kill(proc)

    proc = spawn_agent(mosquitto, "dev-p", data, "--state-interval", "1", fog=fog.fog)
    try:
        fog.wait_leaf("dev-p", "BIRTH", timeout=15)
        fog.seen.clear()
        fog.raw("dev-p", captured)  # the attack: the captured deploy again, its timestamp still fresh
        assert time.time() - sealed_at < 25, "the replay must land inside the timestamp window"
        st = wait_status(data, lambda s: s.get("pid") == proc.pid
                         and sum(s["verifier"]["rejected"].values()) >= 1, timeout=5)
        assert st["partitions"] == [], "the replayed deploy must not run"
        with pytest.raises(AssertionError):
            fog.wait_leaf("dev-p", "ACK", timeout=1.0, cond=lambda m: m.command_id == "dep-1")
        # the legitimate path: a new command from the fog is accepted after the restart
        fog.command("dev-p", fog.fog.deploy("dep-2", CHAIN.parts[0], memory_bytes=1_000_000))
        assert fog.wait_leaf("dev-p", "ACK", timeout=15, cond=lambda m: m.command_id == "dep-2").ok
        assert wait_status(data, lambda s: len(s["partitions"]) == 1)["verifier"]["accepted"] >= 1
    finally:
        kill(proc)
        fog.close()
    assert fog.unverified == 0
