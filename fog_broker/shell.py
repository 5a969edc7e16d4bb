"""What the fog's front ends (control, status, metrics, the HTTP API) may use of the running fog.

A structural type: ``FogService`` satisfies it without naming it, so these modules depend on
this small surface instead of on the service module that imports them (no import cycle).
Reads of the site's decisions go through ``core`` (``SiteCore.view()`` for read-only use) or the
aliases below, on the owner thread (``call``).
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any, Protocol

from runtime.messages import InferenceResult
from runtime.topics import Topics

from .artifacts import ArtifactBuilder
from .controller import Controller
from .registry import Registry
from .releases import ReleaseBook
from .router import Router
from .site import Site
from .site_core import SiteCore
from .store import Store

__all__ = ["FogShell"]


class FogShell(Protocol):
    config: Any          # fog_broker.service.ServiceConfig
    core: SiteCore
    registry: Registry
    controller: Controller
    router: Router
    counters: Counter[str]
    topics: Topics
    epoch: int
    started_mono: float
    events: deque[dict[str, Any]]
    site: Site
    store: Store
    releases: ReleaseBook
    artifacts: ArtifactBuilder
    ingest: Any          # fog_broker.ingest.Ingest
    control: Any         # fog_broker.control.ControlPlane

    def status(self, now: float | None = None, **page: Any) -> dict[str, Any]: ...
    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any: ...
    def infer(self, workload: str, tensors: Mapping[str, Any], timeout: float = 5.0,
              stream: str = "") -> Future[InferenceResult]: ...
    def apply(self, event: Any, now: float | None = None) -> None: ...
    def mark_dirty(self) -> None: ...
    def sync_trust(self) -> None: ...
    def collect_blobs(self) -> None: ...
    def publish_signed(self, topic: str, msg: Any, *, retain: bool = False) -> None: ...
    def refused(self, kind: str, sender: str) -> None: ...


