"""A group of simulated edge agents with custom profiles in one process: ``python -m simulations.agent_group SPEC``.

For tests and benchmarks that need devices of chosen memory and speed
(placement pressure with small models). The real agent code runs
(``edge_agent.runner.make_agent`` with a ``DeviceProfile``); each data dir is
enrolled with the spec's bootstrap token first, exactly as ``fogline agent
--token`` does. SPEC is JSON: ``{"agents": [{"id", "memory", "flops"?,
"labels"?, "link_bps"?, "uplink_bps"?, "downlink_bps"?, "model_compute"?}], "dir", "port", "enroll", "token",
"interval"?, "host"?}`` (``host``: the fog's address when not 127.0.0.1, e.g. from a network namespace).
Start it with ``LocalSite.spawn_agents``. SIGTERM stops the agents cleanly.
"""
from __future__ import annotations

import json
import signal
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["main"]


def main(argv: list[str]) -> int:
    import onnxruntime  # noqa: F401 - imported up front: a first import inside a deploy stalls every agent here

    from edge_agent.agent import AgentConfig
    from edge_agent.credentials import enrolled_settings
    from edge_agent.enrol import enrol_dirs
    from edge_agent.runner import make_agent

    from .profiles import DeviceProfile

    spec: dict[str, Any] = json.loads(argv[0])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *a: stop.set())
    base = Path(spec["dir"])
    ehost, eport = spec["enroll"].rsplit(":", 1)
    host = spec.get("host", "127.0.0.1")  # the fog as reached from here (in a netns: its veth peer)
    ehost = spec.get("host", ehost)
    enrol_dirs(spec["token"], [(a["id"], base / a["id"]) for a in spec["agents"]], ehost, int(eport), timeout_s=60)
    agents = []
    for a in spec["agents"]:
        fog_key, tls, site = enrolled_settings(base / a["id"])
        link = a.get("link_bps", 1e8)  # advertised up- and downlink (the cost model's links)
        prof = DeviceProfile(a["id"], flops=a.get("flops", 5e9), memory_bytes=a["memory"],
                             uplink_bps=a.get("uplink_bps", link), downlink_bps=a.get("downlink_bps", link),
                             rtt_s=0.001, power_active_w=5.0, power_idle_w=2.0,
                             labels=a.get("labels", {}))
        cfg = AgentConfig(device_id=a["id"], data_dir=base / a["id"], host=host, port=spec["port"], site=site,
                          labels=a.get("labels", {}), fog_key=fog_key, tls=tls,
                          state_interval_s=spec.get("interval", 1.0), keepalive=5, intra_op_threads=1,
                          model_compute=bool(a.get("model_compute", False)),
                          max_batch=int(a.get("max_batch", 1)),
                          max_batch_wait_s=float(a.get("max_batch_wait_s", 0.002)),
                          sim_batch_slope=float(a.get("sim_batch_slope", 1.0)))
        agents.append(make_agent(cfg, profile=prof).start())
    print("agents-started", flush=True)
    while not stop.wait(0.5):
        pass
    for ag in agents:
        ag.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
