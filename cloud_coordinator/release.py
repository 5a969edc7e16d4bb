"""Model release: global weights -> ONNX -> signed ``ModelRelease`` -> fog brokers.

The signed release is always written next to the checkpoints (so a release
survives a missing broker); publishing over MQTT is optional and thin.
A release version is the round number, so versions only grow across resumes.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from runtime import codec
from runtime.messages import ModelRelease
from runtime.security import Identity, sign_artifact
from runtime.topics import Topics

from .store import atomic_write

__all__ = ["build_release", "Releaser", "KEY_FILE"]

log = logging.getLogger(__name__)
KEY_FILE = "coordinator.key"


def build_release(weights: Sequence[np.ndarray], identity: Identity, workload: str, version: int,
                  metadata: Mapping[str, str] | None = None, *, onnx_module: str = "models.train",
                  model: str = "softmax") -> ModelRelease:
    """Export, hash and sign; the signed metadata is exactly ``ModelRelease.metadata``."""
    import importlib

    to_onnx = importlib.import_module(onnx_module).to_onnx
    blob = to_onnx([np.asarray(w, dtype=np.float32) for w in weights])
    artifact = blob if isinstance(blob, bytes) else blob.SerializeToString()
    # The public key rides in the signed metadata so a fog broker can pin the coordinator on
    # first use; later releases must verify against the pinned key, not this field.
    meta = {"workload": workload, "version": str(version), "format": "onnx",
            "public_key": identity.public_key_bytes.hex(), **dict(metadata or {})}
    sig = sign_artifact(identity, artifact, meta)
    return ModelRelease(workload, version, sig.sha256, artifact, sig.signature, identity.name, meta)


class Releaser:
    """After-round hook: every ``every`` rounds (and the last) build, store and maybe publish."""

    def __init__(self, out_dir: Path, identity: Identity, workload: str, every: int, total_rounds: int, *,
                 site: str = "default", mqtt: str = "", onnx_module: str = "models.train",
                 model: str = "softmax", config_hash: str = "") -> None:
        self.out_dir = out_dir
        self.identity = identity
        self.workload = workload
        self.every = every
        self.total = total_rounds
        self.site = site
        self.mqtt = mqtt
        self.onnx_module = onnx_module
        self.model = model
        self.config_hash = config_hash
        self.released: list[dict[str, Any]] = []

    @classmethod
    def from_run_config(cls, rc: Mapping[str, Any], ckpt_dir: Path) -> "Releaser | None":
        every = int(rc.get("release-every", 0))
        if every <= 0:
            return None
        key = Path(str(rc.get("identity-key", "")) or ckpt_dir / KEY_FILE)
        ident = Identity.load_or_create(str(rc.get("identity-name", "coordinator")), key)
        return cls(ckpt_dir / "releases", ident, str(rc.get("workload", "digits")), every, int(rc["rounds"]),
                   site=str(rc.get("site", "default")), mqtt=str(rc.get("mqtt", "")),
                   onnx_module=str(rc.get("model-module", "models.train")), model=str(rc.get("model", "softmax")))

    def after_round(self, rnd: int, weights: tuple[np.ndarray, ...], entry: Mapping[str, Any]) -> None:
        if rnd % self.every and rnd != self.total:
            return
        acc = entry.get("accuracy")
        meta = {"round": str(rnd), **({"accuracy": f"{float(acc):.4f}"} if acc is not None else {})}
        rel = build_release(weights, self.identity, self.workload, rnd, meta, onnx_module=self.onnx_module,
                            model=self.model)
        frame = codec.encode(rel)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        path = self.out_dir / f"{self.workload}-v{rnd:06d}.release"
        atomic_write(path, frame)
        record: dict[str, Any] = {"version": rnd, "sha256": rel.sha256, "path": os.fspath(path),
                                  "bytes": len(rel.artifact), "published": False}
        if self.mqtt:
            record["published"] = publish(frame, self.mqtt, self.site, self.identity.name)
        self.released.append(record)
        log.info("released %s v%d (%s, %d bytes)", self.workload, rnd, rel.sha256[:12], len(rel.artifact))


def publish(frame: bytes, mqtt: str, site: str, client_name: str, timeout_s: float = 10.0) -> bool:
    """Publish one encoded ``ModelRelease`` (retained, QoS 1); False if the broker did not ack in time."""
    from runtime.mqtt import MqttClient, parse_hostport

    host, port = parse_hostport(mqtt)
    client = MqttClient(f"{client_name}-release-{os.getpid()}", host, port)
    client.start()
    try:
        if not client.wait_connected(timeout_s):
            log.warning("release: MQTT broker %s not reachable", mqtt)
            return False
        return bool(client.publish(Topics(site).release(), frame, qos=1, retain=True).wait(timeout_s))
    finally:
        client.stop()
