"""Many simulated agents in one process: each its own connection, identity and epoch."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from edge_agent.testing import tiny_chain
from runtime.messages import DeviceBirth, DeviceDeath, InferenceResult

from _agent_harness import REPO, FogSide, kill

pytestmark = pytest.mark.integration


def test_simulated_fleet_in_one_process(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fog = FogSide(mosquitto, site="lab")
    fog.online()
    n = 12
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "--broker", mosquitto.address, "--site", "lab",
                             "--simulate", "camera", "--count", str(n), "--id-prefix", "cam-",
                             "--data-dir", str(tmp_path / "fleet"), "--sim-speedup", "1000",
                             "--state-interval", "2", "--keepalive", "2", *fog.fog.agent_args()],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        births: dict[str, DeviceBirth] = {}
        while len(births) < n:
            _, dev, _, b = fog.wait(lambda d, leaf, m: leaf == "BIRTH" and d not in births, timeout=20)
            births[dev] = b  # type: ignore[assignment]
        assert sorted(births) == [f"cam-{i:02d}" for i in range(n)]
        assert len({b.public_key for b in births.values()}) == n
        b = births["cam-03"]
        assert b.simulated and b.battery_capacity_wh == 20.0 and b.labels["device-model"] == "camera"
        assert b.site == "lab" and b.memory_bytes == 200_000_000

        # simulated devices still run real sessions
        chain = tiny_chain()
        fog.command("cam-03", fog.fog.deploy("d", chain.parts[0], memory_bytes=50_000_000))
        assert fog.wait_leaf("cam-03", "ACK", cond=lambda m: m.command_id == "d").ok
        x = np.ones((1, 8), np.float32)
        act = chain.activation("r", x, [("cam-03", 0)], fog.topics.reply("t"))
        fog.send_activation(act)
        res: InferenceResult = fog.wait(lambda d, leaf, m: isinstance(m, InferenceResult), timeout=10)[3]  # type: ignore[assignment]
        assert res.ok
        st = fog.wait_leaf("cam-03", "STATE", timeout=5, cond=lambda m: m.partitions)
        assert st.free_memory_bytes == 150_000_000  # the simulated device accounts deployed memory
        # the modelled battery drains (1000x speed-up): 1.2 W idle on 20 Wh
        low = fog.wait_leaf("cam-05", "STATE", timeout=10, cond=lambda m: m.battery_level < 0.99)
        assert low.battery_level is not None

        proc.kill()
        deaths = set()
        while len(deaths) < n:
            _, dev, _, d = fog.wait(lambda d, leaf, m: leaf == "DEATH" and d not in deaths, timeout=5)
            assert isinstance(d, DeviceDeath) and d.epoch == births[dev].epoch
            deaths.add(dev)
    finally:
        kill(proc)
        fog.close()


def test_agent_finds_the_fog_with_zeroconf(mosquitto, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from runtime.discovery import advertise

    fog = FogSide(mosquitto, site="zc")
    fog.online()
    ad = advertise("zc", "fog-zc", mosquitto.host, mosquitto.port)
    proc = subprocess.Popen([sys.executable, "-m", "edge_agent", "--id", "found-1", "--site", "zc",
                             "--data-dir", str(tmp_path / "found-1"), "--discovery-timeout", "10",
                             *fog.fog.agent_args()],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        birth = fog.wait_leaf("found-1", "BIRTH", timeout=20)
        assert birth.site == "zc"
    finally:
        kill(proc)
        ad.close()
        fog.close()
