"""What a rollout hears and what it asks for (pure, frozen): the events the adapter feeds ``RolloutBook``
(``siteservice``: a release in the outbox, a site's status, a site lost, the probe's answers, a rollback
written) and the commands it gets back (publish, probe, restore, a line for the log)."""
from __future__ import annotations

from dataclasses import dataclass

from .rollout_checks import ProbeSample, SiteView

__all__ = ["NewRelease", "Seen", "Lost", "ProbeDone", "Restored", "RestoreFailed", "Publish", "Probe", "Restore",
           "Note", "Event", "Command"]


@dataclass(frozen=True, slots=True)
class NewRelease:
    """A release in the outbox. ``published``: sent before staged rollouts existed (adopted as done)."""

    name: str
    version: int
    sha256: str
    file: str
    published: bool = False


@dataclass(frozen=True, slots=True)
class Seen:
    site: str
    view: SiteView


@dataclass(frozen=True, slots=True)
class Lost:
    """The site did not answer (one line: why); timeouts act on it, this only explains them."""

    site: str
    error: str


@dataclass(frozen=True, slots=True)
class ProbeDone:
    name: str
    version: int
    samples: tuple[ProbeSample, ...]


@dataclass(frozen=True, slots=True)
class Restored:
    """The rollback release is in the outbox: ``restores``' bytes as ``as_version``."""

    name: str
    version: int
    as_version: int
    restores: int


@dataclass(frozen=True, slots=True)
class RestoreFailed:
    name: str
    version: int
    reason: str


@dataclass(frozen=True, slots=True)
class Publish:
    site: str
    name: str
    version: int


@dataclass(frozen=True, slots=True)
class Probe:
    site: str
    name: str
    version: int
    workloads: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Restore:
    """Write the first of ``candidates`` that is in the outbox as a new version of ``name`` (> ``version``)."""

    name: str
    version: int
    candidates: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Note:
    text: str
    level: str = "info"   # "info" | "warning"


Event = NewRelease | Seen | Lost | ProbeDone | Restored | RestoreFailed
Command = Publish | Probe | Restore | Note
