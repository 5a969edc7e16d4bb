"""What the fog's front ends (control, status, metrics, the HTTP API, the site page) may use of it.

A structural type: ``FogService`` satisfies it without naming it, so the front ends depend on this
small surface, never on the service module that imports them (no import cycle; keep it out of
``service.py``). They read the site only through ``snapshot()`` -- a frozen ``SiteSnapshot`` any
thread may hold -- and change it only through ``apply(event)``; the registry, the controller and
the router are not here (an import contract in pyproject.toml keeps them out of the front ends).
The rest are the process's I/O services: the trust database, the store, the artifacts, the
release book, the ingest and control counters, signing and the clock's origin.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: the port itself imports nothing of the fog
    from collections import Counter, deque
    from collections.abc import Callable, Mapping
    from concurrent.futures import Future

    from runtime.messages import InferenceResult
    from runtime.topics import Topics

    from .artifacts import ArtifactBuilder
    from .site import Site
    from .snapshot import SiteSnapshot
    from .store import ReleaseBook, Store

__all__ = ["FogPort"]


class FogPort(Protocol):
    config: Any          # fog_broker.service.ServiceConfig
    counters: Counter[str]  # the site's counters: a front end counts its refusals here
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

    def snapshot(self, max_age_s: float | None = None, timeout: float = 5.0) -> SiteSnapshot:
        """The site now (owner thread: fresh) or at most ``max_age_s`` old (any thread; waits up to
        ``timeout`` for the owner to build a newer one, then gives the newest it has)."""
        ...

    def status(self, now: float | None = None, *, snapshot: SiteSnapshot | None = None,
               max_age_s: float | None = None, **page: Any) -> dict[str, Any]: ...
    def call(self, fn: Callable[[], Any], timeout: float = 10.0) -> Any: ...
    def infer(self, workload: str, tensors: Mapping[str, Any], timeout: float = 5.0,
              stream: str = "") -> Future[InferenceResult]: ...
    def apply(self, event: Any, now: float | None = None) -> None: ...
    def mark_dirty(self) -> None: ...
    def sync_trust(self) -> None: ...
    def collect_blobs(self) -> None: ...
    def publish_signed(self, topic: str, msg: Any, *, retain: bool = False) -> None: ...
    def refused(self, kind: str, sender: str) -> None: ...
