"""The controller's apply stage: a plan's partitions become assignments and deploy commands.

It owns the command side of the book: command ids, sending what is due with an ack window sized
to the artifact, the ack deadlines and their backoff, and undeploys.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..placement.model import Fleet
from ..placement.plan import PartitionPlacement, ReplicaPlacement
from .model import (
    AWAIT_BUILD,
    Assignment,
    Command,
    DeployPartition,
    PartKey,
    Persist,
    Phase,
    UndeployPartition,
    WorkloadEntry,
)

if TYPE_CHECKING:
    from ._core import Controller

__all__ = ["Applier"]


class Applier:
    """Assignments and commands of the controller ``c`` (its one owner thread drives both)."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller

    def cmd_id(self) -> str:
        c = self.c
        c._seq += 1
        return f"{c.prefix}-{c._seq}"

    def mark_running(self, a: Assignment, now: float) -> None:
        c = self.c
        if a.phase is Phase.RUNNING:
            return
        a.phase = Phase.RUNNING
        a.running_since = now
        a.reason = ""
        sent = c._first_sent.pop(a.key, None)
        if sent is not None:
            c.deploy_latencies.append(now - sent)
        if not math.isnan(a.lost_at):
            c.recoveries.append(now - a.lost_at)
            a.lost_at = math.nan

    def undeploy(self, dev: str, key: PartKey) -> UndeployPartition:
        c = self.c
        c.counters["undeploys"] += 1
        return UndeployPartition(self.cmd_id(), dev, *key)

    def retry_or_move(self, a: Assignment, now: float) -> list[Command]:
        c = self.c
        a.attempts += 1
        if a.attempts >= c.config.max_attempts:
            a.excluded = a.excluded | {a.device}
            a.phase, a.lost_at = Phase.LOST, now
            a.reason = f"gave up on {a.device} after {a.attempts} attempts: {a.reason}"
            return []
        a.phase = Phase.PENDING
        a.next_try = now + min(c.config.backoff_s * 2 ** (a.attempts - 1), c.config.backoff_max_s)
        c.counters["retries"] += 1
        return []

    def drop_workload(self, name: str) -> list[Command]:
        c = self.c
        out: list[Command] = []
        for key in [k for k in c.assignments if k[0] == name]:
            a = c.assignments.pop(key)
            if a.phase is not Phase.LOST:
                out.append(self.undeploy(a.device, key))
        out.append(Persist(name))
        return out

    def drop_assignments(self, name: str) -> list[Command]:
        c = self.c
        out: list[Command] = []
        keys = [k for k in c.assignments if k[0] == name]
        for key in keys:
            a = c.assignments.pop(key)
            if a.phase is not Phase.LOST:
                out.append(self.undeploy(a.device, key))
        if keys:
            out.append(Persist(name))
        return out

    def apply(self, entry: WorkloadEntry, replicas: Sequence[ReplicaPlacement], now: float,
               lost_at: float, indices: Sequence[int] | None = None) -> list[Command]:
        """Make the assignments those of ``replicas`` (on replica ``indices``, default 0..n-1)."""
        c = self.c
        name, version = entry.spec.name, entry.version
        out: list[Command] = []
        want: dict[PartKey, PartitionPlacement] = {}
        for r, rep in enumerate(replicas):
            for i, p in enumerate(rep.partitions):
                want[(name, version, indices[r] if indices else r, i)] = p
        changed = False
        for key in [k for k in c.assignments if k[0] == name and k not in want]:
            gone = c.assignments.pop(key)
            changed = True
            if gone.phase is not Phase.LOST:
                out.append(self.undeploy(gone.device, key))
        for key, p in want.items():
            a = c.assignments.get(key)
            if a is not None and a.device == p.device and a.first == p.first and a.last == p.last:
                continue
            if a is not None and a.phase is not Phase.LOST:
                out.append(self.undeploy(a.device, key))
            # Same key, same device, other segments: that device's reports of the key describe the
            # old partition until the new artifact's sha is known, so they must not count as ours.
            sha = AWAIT_BUILD if a is not None and a.device == p.device else ""
            c.assignments[key] = Assignment(key, p.device, p.first, p.last, sha256=sha, next_try=now,
                                               lost_at=lost_at)
            c._first_sent.pop(key, None)
            changed = True
        if changed:
            out.append(Persist(name))
        return out

    def expire(self, now: float) -> None:
        c = self.c
        for a in c.assignments.values():
            if a.phase is Phase.DEPLOYING and now >= a.deadline:
                a.reason = f"no ack from {a.device} within {a.ack_window_s:.3g} s"
                c._by_command.pop(a.command_id, None)
                self.retry_or_move(a, now)

    def ack_window(self, a: Assignment, fleet: Fleet) -> float:
        """Seconds a deploy of ``a`` may take to be acked: ``ack_timeout_s`` plus
        ``transfer_safety`` times its artifact's transfer (the partition's param bytes) over
        the device's downlink. A fixed window resends a large partition to a slow device before
        it can arrive (each resend queues the artifact again on the same link) until the device
        is given up and the workload re-planned."""
        c = self.c
        entry, device = c.workloads.get(a.workload), fleet.get(a.device)
        prof = entry.spec.profile if entry is not None else None
        if prof is None or device is None or c.config.transfer_safety <= 0:
            return c.config.ack_timeout_s
        size = sum(s.param_bytes for s in prof.segments[a.first:a.last + 1])
        return c.config.ack_timeout_s + c.config.transfer_safety * 8 * size / device.downlink_bps

    def send_due(self, fleet: Fleet, now: float) -> list[Command]:
        c = self.c
        out: list[Command] = []
        for a in sorted(c.assignments.values(), key=lambda a: a.key):
            if a.phase is Phase.PENDING and now >= a.next_try:
                a.phase = Phase.DEPLOYING
                a.command_id = self.cmd_id()
                a.ack_window_s = self.ack_window(a, fleet)
                a.deadline = now + a.ack_window_s
                c._by_command[a.command_id] = a.key
                c._first_sent.setdefault(a.key, now)
                c.counters["deploys"] += 1
                out.append(DeployPartition(a.command_id, a.device, *a.key, a.first, a.last, a.attempts + 1))
        return out
