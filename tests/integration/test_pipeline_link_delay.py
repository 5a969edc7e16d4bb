"""Issue 21, links that behave like links: one stage's worker reaches the fog's mosquitto through
a ``WanLink`` (``simulations.wan_relay``) that delays each direction 40 ms, on a real secure site.

Every frame crosses that link into the stage and out of it again, so a request takes at least
twice the one-way delay (a lower bound, true on any busy machine), and a window of frames in
flight hides the delay that one-at-a-time pays per frame: the point of pipelining on a WAN.
The agents enrol directly (the enrolment port is not relayed) and reach MQTT at the relay's
port on 127.0.0.1, a name the fog's certificate already carries.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import test_pipeline as pipeline

from simulations.local_site import LocalSite
from simulations.wan_relay import WanLink

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

DELAY_S = 0.04  # one way, each direction
CAM, _reference, _worker = pipeline.CAM, pipeline._reference, pipeline._worker
site = pipeline.site  # the fixture: a fresh secure site per test, as in test_pipeline.py


def test_frames_cross_a_delayed_link_in_order_and_a_window_hides_its_delay(
        site: tuple[LocalSite, Path]) -> None:
    fog, tmp = site
    wan = WanLink(fog.port, delay_s=DELAY_S)
    groups = [fog.spawn_agents([CAM, _worker(1)], tmp / "agents", tmp / "agents.log")]
    try:
        groups.append(fog.spawn_agents([_worker(0)], tmp / "agents", tmp / "w0.log",
                                       port=wan.port))
        c = fog.client()
        wait_for(lambda: {d["id"] for d in c.status()["devices"] if d["alive"]}
                 >= {"cam", "w0", "w1"}, 60, "3 agents alive")
        assert wan.connections >= 1  # w0's MQTT session goes through the relay
        c.deploy({"name": "res", "model": "zoo:resnet", "source": "cam", "sink": "cam",
                  "selectors": {"role": "worker"}, "objective": "throughput",
                  "min_partitions": 2, "max_partitions": 2})
        w = c.wait_running("res", 60)
        stages = [p["device"] for p in w["placement"][0]["partitions"]]
        assert sorted(stages) == ["w0", "w1"], stages  # one stage is behind the delayed link

        rng = np.random.default_rng(4)
        xs = [rng.random((1, 3, 32, 32), dtype=np.float32) for _ in range(24)]
        c.infer_many("res", [{"x": x} for x in xs[:2]], window=1, timeout=30)  # warm
        lat = []
        for x in xs[:8]:  # one at a time: each frame pays the link's delay in full
            t0 = time.perf_counter()
            res = c.infer_result("res", {"x": x}, 20)
            lat.append(time.perf_counter() - t0)
            assert res.ok, res.error
        serial = len(lat) / sum(lat)
        relayed = wan.up + wan.down
        t0 = time.perf_counter()
        results = list(c.stream_results("res", ({"x": x} for x in xs), window=6, timeout=20))
        piped = len(xs) / (time.perf_counter() - t0)
        print(f"w0 behind {DELAY_S * 1e3:.0f} ms each way: one at a time {serial:.1f} frames/s "
              f"(latency min {min(lat) * 1e3:.0f} ms, median {sorted(lat)[4] * 1e3:.0f} ms), "
              f"window 6 {piped:.1f} frames/s ({piped / serial:.2f}x); "
              f"{wan.up + wan.down - relayed} B relayed for the stream")

        assert len(results) == len(xs) and all(r.ok for r in results), [r.error for r in results]
        for x, r in zip(xs, results):  # in order: each answer is its own frame's
            ref = _reference(x)
            out = np.asarray(r.tensors["logits"])
            assert float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) < 1e-4
        assert min(lat) >= 2 * DELAY_S, lat  # into the stage and out again, 40 ms each
        assert wan.up + wan.down - relayed > 0 and wan.delayed > 0 and wan.lost == 0
        assert piped > 1.3 * serial, (serial, piped)
        c.close()
    finally:
        for g in groups:
            if g.poll() is None:
                g.kill()
            g.wait(5)
        wan.close()
