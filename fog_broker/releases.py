"""Model releases a fog follows: signed by a pinned coordinator, bound to it, only forward.

``release:NAME`` workloads run the newest accepted release of NAME. The
decision is ``fog_broker.trust.decide_release``; this module checks the
artifact signature, keeps ``releases.json`` and the uploaded bytes.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.errors import SecurityError
from runtime.files import atomic_write
from runtime.messages import ModelRelease
from runtime.security import ArtifactSignature, verify_artifact

from .trust import decide_release

__all__ = ["ReleaseBook"]

log = logging.getLogger("fog_broker.releases")


class ReleaseBook:
    """The accepted releases by name: {version, model ref, signer, metadata}; persisted atomically."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.releases: dict[str, dict[str, Any]] = json.loads(path.read_text()) if path.exists() else {}
        except ValueError:
            log.error("%s is unreadable; starting with no releases", path)
            self.releases = {}

    def check(self, msg: ModelRelease, pinned: Mapping[str, bytes]) -> str:
        """'' when ``msg`` should be accepted, else the counted reason it is not."""
        known = self.releases.get(msg.workload)
        verdict = decide_release(msg.workload, msg.version, msg.signer, pinned,
                                 known["signer"] if known else None, known["version"] if known else None)
        if not verdict.accept:
            return verdict.reason
        try:
            verify_artifact(pinned[msg.signer], msg.artifact,
                            ArtifactSignature(msg.sha256, msg.signer, msg.signature, dict(msg.metadata)))
        except SecurityError as exc:
            return f"bad signature ({exc.reason})"
        # The signature covers the metadata, not the message's own name and version fields: a
        # captured release resent as v999999999, or under another name, must not pass as one.
        if msg.metadata.get("workload") != msg.workload or msg.metadata.get("version") != str(msg.version):
            return "relabelled (name or version differ from the signed ones)"
        return ""

    def accept(self, msg: ModelRelease, ref: str) -> None:
        self.releases[msg.workload] = {"version": msg.version, "model": ref, "signer": msg.signer,
                                       "metadata": {k: v for k, v in msg.metadata.items() if k != "public_key"}}
        atomic_write(self.path, json.dumps(self.releases, indent=1))

    def get(self, name: str) -> dict[str, Any] | None:
        return self.releases.get(name)

    def refs(self) -> set[str]:
        return {r["model"] for r in self.releases.values()}

    def view(self) -> dict[str, Any]:
        return {n: {**r["metadata"], "version": r["version"], "signer": r["signer"], "model": r["model"]}
                for n, r in self.releases.items()}
