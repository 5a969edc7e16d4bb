"""Issue 21 on a real shaped link: a stage that saturates its slow uplink with activations stays
alive at the fog (its STATE adverts do not queue behind seconds of frames) and measures its
uplink near the shaped rate (queued frames are timed from the previous ack, not from their send).

The first stage's agent runs in its own network namespace behind the kernel's token bucket
(``simulations.netshape``); a streaming client keeps a big window of frames in flight for
~15 s, more than the link carries, so the agent's publishes back up.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from runtime import children
from runtime.broker import find_mosquitto
from simulations.local_site import LocalSite

from waiting import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

if find_mosquitto() is None:  # pragma: no cover - make test installs it
    pytest.skip("mosquitto not installed", allow_module_level=True)

CAM = {"id": "cam", "memory": 1000, "flops": 1e8, "labels": {"role": "source", "power-domain": "pc"}}
BPS = 2e6
DOWN_BPS = 20e6
SIZE = 64  # 3x64x64 images: the cut's activations (~128 KB) over the estimator's "large" mark
SATURATE_S = 15.0


def _worker(i: int) -> dict[str, Any]:
    return {"id": f"w{i}", "memory": 50_000_000, "flops": 5e9, "link_bps": BPS,
            "labels": {"role": "worker", "power-domain": f"pd{i}"}}


def _workload(c: Any, name: str) -> dict[str, Any]:
    return next(w for w in c.status()["workloads"] if w["name"] == name)


def test_a_saturated_slow_uplink_keeps_the_device_alive_and_measured(tmp_path: Path) -> None:
    from models import zoo
    from simulations.netshape import NetShape

    why = NetShape.probe()
    if why is not None:  # pragma: no cover - CI runs as root with iproute2
        pytest.skip(f"shaped links unavailable: {why}")
    with NetShape() as shape:
        # a fast downlink: the frames' inputs arrive at once, and the acks come straight back
        links = [shape.add(BPS, DOWN_BPS), shape.add(BPS, DOWN_BPS)]
        fog_log = tmp_path / "fog.log"
        fog = LocalSite(tmp_path / "fog", site=f"t{uuid.uuid4().hex[:8]}", host="0.0.0.0", log=fog_log,
                        args=["--state-interval", "1", "--startup-wait", "2", "--summary-interval",
                              "1", *[a for ln in links for a in ("--san", ln.host_ip)]])
        fog.start()
        agents = tmp_path / "agents"
        groups = [fog.spawn_agents([CAM], agents, tmp_path / "cam.log", host="127.0.0.1")]
        stop = threading.Event()
        try:
            for i, ln in enumerate(links):
                groups.append(fog.spawn_agents([_worker(i)], agents, tmp_path / f"w{i}.log",
                                               host=ln.host_ip, wrap=ln.wrap))
            c = fog.client()
            wait_for(lambda: {d["id"] for d in c.status()["devices"] if d["alive"]}
                     >= {"cam", "w0", "w1"}, 60, "3 agents alive")
            (tmp_path / "resnet64.onnx").write_bytes(zoo.build("resnet", size=SIZE).SerializeToString())
            c.deploy({"name": "f32", "model": "resnet64.onnx", "source": "cam", "sink": "cam",
                      "selectors": {"role": "worker"}, "objective": "throughput",
                      "min_partitions": 2, "max_partitions": 2}, base_dir=tmp_path, timeout=60)
            c.wait_running("f32", 90)
            rng = np.random.default_rng(3)
            xs = [{"x": rng.random((1, 3, SIZE, SIZE), dtype=np.float32)} for _ in range(4)]
            c.infer_many("f32", xs[:2], window=1, timeout=30)  # warm
            row = _workload(c, "f32")["placement"][0]
            first = row["partitions"][0]["device"]  # its uplink carries the cut's activations
            cut = next(s for s in row["stages"] if s["stage"].startswith(f"link {first}->"))
            nbytes = cut["bytes_per_frame"]
            frames = max(16, int(SATURATE_S * BPS / 8 / nbytes))
            epoch0 = next(d["epoch"] for d in c.status()["devices"] if d["id"] == first)

            seen: list[tuple[float, str, int, str | None]] = []  # (t, status, epoch, lost_reason)

            def watch() -> None:
                while not stop.wait(0.2):
                    try:
                        d = next(d for d in c.status()["devices"] if d["id"] == first)
                    except Exception:  # noqa: BLE001 - a status call timing out is not the point
                        continue
                    seen.append((time.monotonic(), d["status"], d["epoch"], d["lost_reason"]))

            watcher = threading.Thread(target=watch, daemon=True)
            watcher.start()
            t0 = time.monotonic()
            results = list(c.stream_results("f32", (xs[i % len(xs)] for i in range(frames)),
                                            window=24, timeout=90))
            took = time.monotonic() - t0
            stop.set()
            watcher.join(10)
            status = json.loads((agents / first / "status.json").read_text())
            uplink = status["link"]["uplink_bps"]
            lost = [s for s in seen if s[1] not in ("live", "suspect") or s[2] != epoch0 or s[3]]
            lost_lines = [ln for ln in fog_log.read_text(errors="replace").splitlines()
                          if "lost" in ln and first in ln]
            report = (f"{first}: {frames} frames of {nbytes} B in {took:.1f} s "
                      f"({8 * frames * nbytes / took / 1e6:.2f} Mbit/s on the wire); "
                      f"advertised uplink {(uplink or 0) / 1e6:.2f} Mbit/s of {BPS / 1e6:.1f}; "
                      f"worst status {sorted({s[1] for s in seen})}; lost samples {lost[:3]}; "
                      f"fog log {lost_lines[:2]}; answered {sum(r.ok for r in results)}/{frames}; "
                      f"lane {status.get('lane')}")
            print("\n" + report)
            assert not lost and not lost_lines, report
            assert took > 0.6 * SATURATE_S, report  # the link really was the bottleneck
            assert uplink is not None and abs(uplink - BPS) < 0.3 * BPS, report
            assert all(r.ok for r in results), report
            c.close()
        finally:
            stop.set()
            children.stop_all(groups, 10.0)
            fog.kill()
