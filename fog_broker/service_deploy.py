"""Carrying out the controller's commands (``service.FogService``): deploys, undeploys, stored assignments.

Artifact building (ONNX split, hash, sign) and each cut's wire calibration run on their own thread,
never on the owner thread; what they find goes back to the owner's inbox as core events
(``Built``, ``BuildFailed``, ``WiresMeasured``). Everything else here runs on the owner thread.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
from typing import TYPE_CHECKING, Any

from runtime.messages import Deploy, Undeploy

from . import wires
from .controller import DeployPartition, Persist, UndeployPartition
from .service_config import STOP
from .site_core import BuildFailed, Built
from .store import StoredAssignment

if TYPE_CHECKING:
    from .service import FogService

__all__ = ["Deployer"]

log = logging.getLogger("fog_broker.service")


class Deployer:
    """The controller's commands, and the artifact thread that builds what a deploy sends."""

    def __init__(self, svc: FogService) -> None:
        self.svc = svc
        self._builds: queue.Queue[Any] = queue.Queue()
        self._builder = threading.Thread(target=self._build_loop, name="fog-artifacts", daemon=True)

    def start(self) -> None:
        self._builder.start()

    def stop(self) -> None:
        self._builds.put(STOP)

    def execute(self, cmds: list[Any]) -> None:
        svc = self.svc
        persist: set[str] = set()
        for cmd in cmds:
            if isinstance(cmd, DeployPartition):
                self._deploy(cmd)
            elif isinstance(cmd, UndeployPartition):
                svc.counters["undeploys_sent"] += 1
                svc.publish_signed(svc.topics.device(cmd.device, "CMD"),
                                   Undeploy(cmd.command_id, cmd.workload, cmd.version, cmd.replica, cmd.index))
            elif isinstance(cmd, Persist):
                persist.add(cmd.workload)
        for name in persist:
            self._persist(name)

    def collect_blobs(self) -> None:
        """Delete uploaded/released model files no workload or release refers to any more."""
        svc = self.svc
        keep = set(svc.releases.refs())
        for e in svc.controller.workloads.values():
            if e.spec.model:
                keep.add(e.spec.model)
        for sw in svc.store.workloads():
            m = sw.spec.get("model")
            if isinstance(m, str):
                keep.add(m)
        gone = svc.artifacts.collect(keep)
        if gone:
            svc.counters["blobs_collected"] += gone

    def _deploy(self, cmd: DeployPartition) -> None:
        """Owner thread: hand the deploy to the artifact thread (split + sign + publish)."""
        svc = self.svc
        entry = svc.controller.workloads.get(cmd.workload)
        if entry is None or entry.spec.model is None or entry.spec.profile is None:
            return
        memory = math.ceil(entry.spec.profile.memory_of(cmd.first, cmd.last))
        self._builds.put((cmd, entry.spec.model, memory, entry.spec.input_shapes))
        job = wires.deploy_job(cmd, entry.spec, svc.controller.assignments_of(cmd.workload),
                               svc.artifacts, svc.inputs.put)  # each cut's wire (issue 21)
        if job is not None:
            self._builds.put(job)

    def _build_loop(self) -> None:
        try:  # warm up: the first deploy after a failure should not wait for imports
            import models.cuts
            import models.partition
            import models.zoo  # noqa: F401
        except Exception:
            log.exception("models package failed to import; deploys will fail")
        while True:
            item = self._builds.get()
            if item is STOP:
                return
            if callable(item):  # an activation-wire calibration (fog_broker.wires)
                item()
                continue
            cmd, ref, memory, shapes = item
            try:
                self._build_and_send(cmd, ref, memory, shapes)
            except Exception as exc:  # noqa: BLE001 - a model we cannot split: NACK ourselves
                log.error("cannot build partition %s [%d, %d]: %s", cmd.workload, cmd.first, cmd.last, exc)
                self.svc.inputs.put(BuildFailed(cmd, f"artifact build failed: {exc}"[:300]))

    def _build_and_send(self, cmd: DeployPartition, ref: str, memory: int, shapes: Any) -> None:
        svc = self.svc
        key = (cmd.workload, cmd.version, cmd.replica, cmd.index)
        built = svc.artifacts.build(ref, cmd.first, cmd.last, shapes)
        svc.inputs.put(Built(key, built.sha256))
        sig = svc.artifacts.sign(built, cmd.workload, cmd.version, cmd.replica, cmd.index)
        msg = Deploy(cmd.command_id, cmd.workload, cmd.version, cmd.replica, cmd.index, built.sha256,
                     built.onnx_bytes, sig.signature, sig.signer, memory, built.inputs, built.outputs,
                     {k: str(v) for k, v in sig.metadata.items()})
        svc.counters["deploys_sent"] += 1
        log.info("deploy %s v%d r%d p%d [%d-%d] -> %s (attempt %d)", cmd.workload, cmd.version, cmd.replica,
                 cmd.index, cmd.first, cmd.last, cmd.device, cmd.attempt)
        svc.publish_signed(svc.topics.device(cmd.device, "CMD"), msg)

    def _persist(self, name: str) -> None:
        svc = self.svc
        rows = [StoredAssignment(a.key[0], a.key[1], a.key[2], a.key[3], a.first, a.last, a.device, a.sha256)
                for a in svc.controller.persisted_of(name)]  # a switch's old partitions too
        svc.store.replace_assignments(name, rows)
