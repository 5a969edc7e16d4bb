"""A ~10 MB partition deployed over a real 10 Mbit/s downlink (``simulations.netshape``: the
device's agent in a network namespace of its own, the kernel's token bucket on its veth pair)
runs on the first attempt: the fog's ack window covers the transfer (8+ s, where a fixed 5 s
resent it until the device was given up), and the chain answers."""
from __future__ import annotations

import uuid
from pathlib import Path

import numpy as np
import pytest

from runtime import children
from runtime.broker import find_mosquitto
from simulations.local_site import LocalSite

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

if find_mosquitto() is None:  # pragma: no cover - make test installs it
    pytest.skip("mosquitto not installed", allow_module_level=True)

CAM = {"id": "cam", "memory": 1000, "flops": 1e8, "labels": {"role": "source", "power-domain": "pc"}}
DOWN = 10e6


def _big_mlp(path: Path) -> int:
    """A 64 -> 36000 -> 10 MLP (~10.6 MB of float32 weights) written to ``path``; its bytes."""
    from models import zoo

    path.write_bytes(zoo.build("mlp", hidden=36_000).SerializeToString())
    return path.stat().st_size


def test_a_10mb_partition_deploys_first_time_over_a_10mbit_downlink(tmp_path: Path) -> None:
    from simulations.netshape import NetShape

    why = NetShape.probe()
    if why is not None:  # pragma: no cover - CI runs as root with iproute2
        pytest.skip(f"shaped links unavailable: {why}")
    size = _big_mlp(tmp_path / "big.onnx")
    assert 8 * size / DOWN > 8.0  # the transfer alone outlasts the old fixed 5 s window
    with NetShape() as shape:
        link = shape.add(1e9, DOWN)
        fog = LocalSite(tmp_path / "fog", site=f"t{uuid.uuid4().hex[:8]}", host="0.0.0.0",
                        log=tmp_path / "fog.log",
                        args=["--state-interval", "1", "--startup-wait", "2", "--summary-interval",
                              "1", "--san", link.host_ip])
        fog.start()
        groups = [fog.spawn_agents([CAM], tmp_path / "agents", tmp_path / "cam.log",
                                   host="127.0.0.1")]
        try:
            slow = {"id": "slow1", "memory": 200_000_000, "flops": 5e9, "uplink_bps": 1e9,
                    "downlink_bps": DOWN, "labels": {"role": "worker", "power-domain": "slow"}}
            groups.append(fog.spawn_agents([slow], tmp_path / "agents", tmp_path / "slow.log",
                                           host=link.host_ip, wrap=link.wrap))
            c = fog.client()
            wait_for(lambda: {d["id"] for d in c.status()["devices"] if d["alive"]}
                     >= {"cam", "slow1"}, 60, "2 agents alive")
            c.deploy({"name": "big", "model": str(tmp_path / "big.onnx"), "source": "cam",
                      "sink": "cam", "selectors": {"role": "worker"}, "max_partitions": 1},
                     timeout=60)
            w = c.wait_running("big", 90)
            assert [p["device"] for p in w["placement"][0]["partitions"]] == ["slow1"]
            counters = c.status()["counters"]
            assert counters.get("controller.deploys") == 1, counters
            assert counters.get("controller.retries", 0) == 0, counters
            x = np.random.default_rng(0).random((1, 64), dtype=np.float32)
            out = c.infer("big", {"x": x}, timeout=20)
            assert next(iter(out.values())).shape == (1, 10)
            c.close()
        finally:
            children.stop_all(groups, 10.0)
            fog.kill()
