"""Run one agent, or many simulated agents in one process, until SIGTERM / SIGINT."""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
import zlib
from typing import Any

from .agent import Agent, AgentConfig
from .profiles import DeviceProfile

__all__ = ["run_agents", "make_agent"]

log = logging.getLogger(__name__)


def make_agent(cfg: AgentConfig, *, profile: DeviceProfile | None = None, speedup: float = 1.0,
               flops: float | None = None) -> Agent:
    """An agent with the live probe, or a simulated device when ``profile`` is given."""
    probe: Any
    if profile is not None:
        from .simulated import SimulatedDevice

        probe = SimulatedDevice(profile, seed=zlib.crc32(cfg.device_id.encode()), speedup=speedup)
    else:
        from .probes.live import LiveProbe

        # FOGLINE_PROBE_ROOT: the host's /proc and /sys mounted elsewhere (a container);
        # FOGLINE_METERED=yes|no: the owner's word on the link, over NetworkManager's guess.
        probe = LiveProbe(os.environ.get("FOGLINE_PROBE_ROOT") or "/", flops=flops,
                          metered=_yes_no(os.environ.get("FOGLINE_METERED")))
    return Agent(cfg, probe)


def _yes_no(value: str | None) -> bool | None:
    """An environment switch: yes/no (also 1/0, true/false); None when unset or anything else."""
    v = (value or "").strip().lower()
    return True if v in ("1", "yes", "true", "on") else False if v in ("0", "no", "false", "off") else None


def run_agents(cfgs: list[AgentConfig], *, profile: DeviceProfile | None = None, speedup: float = 1.0,
               flops: float | None = None) -> int:
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agents: list[Agent] = []
    try:
        for cfg in cfgs:
            agents.append(make_agent(cfg, profile=profile, speedup=speedup, flops=flops).start())
            if len(cfgs) > 1:
                time.sleep(0.005)  # spread a fleet's connects a little
            if stop.is_set():
                break
        log.info("%d agent(s) started against %s:%d site %s", len(agents), cfgs[0].host, cfgs[0].port,
                    cfgs[0].site)
        while not stop.wait(1.0):
            pass
    finally:
        for a in agents:
            a.stop()
    return 0
