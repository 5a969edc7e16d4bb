"""The fog broker's settings and the owner thread's inbox items (``service.FogService``).

Core events (Built, BuildFailed, WiresMeasured from the artifact thread; ingest's Heard batches)
go to the site core as they are; the items here are the shell's own jobs for its owner thread.
"""
from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runtime.messages import InferenceRequest
from runtime.mqtt import TlsConfig

from .control import MAX_REQUEST_BYTES
from .controller import ControllerConfig
from .router import RouterConfig

__all__ = ["ServiceConfig", "default_schedule", "MAX_CONTROL_BYTES", "MAX_ADVERT_BYTES", "LOCAL", "STOP",
           "WAKE", "Wake", "Other", "LocalInfer", "Call", "SyncTrust", "RebirthAll"]

MAX_CONTROL_BYTES = MAX_REQUEST_BYTES
MAX_ADVERT_BYTES = 64 * 1024
LOCAL = "local:"  # reply_to of requests from this process (never an MQTT topic: no '/')
STOP = object()   # the owner's and the artifact thread's end of input


@dataclass(frozen=True, slots=True)
class Wake:
    """A live or control item is waiting in its lane (the owner blocks on the inbox)."""


@dataclass(frozen=True, slots=True)
class Other:
    """A decoded control request, inference request, hop result or release, to authenticate."""
    kind: str
    msg: Any
    at: float
    sender: str = ""  # the topic's id (the identity the broker authenticated)


@dataclass(frozen=True, slots=True)
class LocalInfer:
    """A request from a front end of this process (the HTTP API)."""
    request: InferenceRequest
    at: float


@dataclass(frozen=True, slots=True)
class Call:
    fn: Callable[[], Any]
    future: Future[Any]


@dataclass(frozen=True, slots=True)
class SyncTrust:
    """trust.db changed in another thread of this process: re-read it."""


@dataclass(frozen=True, slots=True)
class RebirthAll:
    """The fog (re)connected: every device is asked for a fresh birth."""
    reason: str


WAKE = Wake()


def default_schedule() -> Callable[..., Any]:
    """The placement scheduler (``fog_broker.placement.schedule``)."""
    from . import placement
    fn: Callable[..., Any] | None = getattr(placement, "schedule", None)
    if fn is None:
        from .placement.scheduler import schedule
        fn = schedule
    return fn


@dataclass
class ServiceConfig:
    data_dir: Path
    site: str = "default"
    fog_id: str = ""
    mqtt_host: str = "127.0.0.1"
    mqtt_port: int = 1883
    tls: TlsConfig | None = None       # the fog's TLS client identity; None: plain MQTT (--insecure)
    state_interval_s: float = 10.0     # the default until a birth says otherwise
    tick_s: float = 0.05
    reconcile_interval_s: float = 0.5
    summary_interval_s: float = 3.0
    time_hint_s: float = 5.0
    trust_poll_s: float = 0.5
    startup_wait_s: float | None = None  # None: one state interval
    battery_floor: float = 0.3
    keepalive: int = 5
    verify_workers: int = 2
    verify_processes: bool = False     # verify in worker processes (one per shard) instead of threads
    max_rebirths_per_s: float = 200.0  # all devices together: a flood cannot make the fog a flood
    fair_share: bool = True            # per-sender budgets at ingest and on fog/CTL (off: benchmarks)
    # fog/CTL requests (status, deploy) are taken ahead of the inbox (budgeted per sender upstream);
    # off: they wait behind inference requests and results, as before issue 31 (benchmarks)
    control_lane: bool = True
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    router: RouterConfig = field(default_factory=RouterConfig)  # spread=False, admit=False: the old router

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir)
        if not self.fog_id:
            self.fog_id = f"fog-{self.site}"
