"""The command core: decide whether a verified Deploy may run here, with a reason when not.

Pure: hash, artifact signature, metadata and memory checks over values the
shell passes in. Reasons are fixed phrases (counted); details go beside them.
"""
from __future__ import annotations

from dataclasses import dataclass

from runtime.errors import SecurityError
from runtime.messages import Deploy, Taint
from runtime.verify import ArtifactSignature, sha256_hex, verify_artifact

__all__ = ["Verdict", "check_deploy", "expected_metadata", "parse_taints", "parse_labels",
           "NO_FOG_KEY", "HASH_MISMATCH", "BAD_ARTIFACT_SIGNATURE", "METADATA_MISMATCH",
           "INSUFFICIENT_MEMORY", "ARTIFACT_TOO_LARGE", "NO_ARTIFACT", "LOAD_FAILED"]

NO_FOG_KEY = "no fog key pinned"
HASH_MISMATCH = "hash mismatch"
BAD_ARTIFACT_SIGNATURE = "bad artifact signature"
METADATA_MISMATCH = "metadata mismatch"
INSUFFICIENT_MEMORY = "insufficient memory"
ARTIFACT_TOO_LARGE = "artifact too large"
NO_ARTIFACT = "artifact missing"
LOAD_FAILED = "load failed"


@dataclass(frozen=True, slots=True)
class Verdict:
    ok: bool
    reason: str = ""
    detail: str = ""

    @property
    def message(self) -> str:
        return f"{self.reason}: {self.detail}" if self.detail else self.reason


def expected_metadata(d: Deploy) -> dict[str, str]:
    """The artifact signature metadata a Deploy must carry (docs/protocol.md)."""
    return {"workload": d.workload, "version": str(d.version), "replica": str(d.replica), "index": str(d.index)}


def check_deploy(d: Deploy, artifact: bytes | None, *, fog_key: bytes | None, free_memory_bytes: int,
                 max_artifact_bytes: int) -> Verdict:
    """Verdict on a Deploy whose envelope already verified; ``artifact`` may come from the cache."""
    if fog_key is None:
        return Verdict(False, NO_FOG_KEY)
    if artifact is None or not artifact:
        return Verdict(False, NO_ARTIFACT, d.sha256[:12])
    if len(artifact) > max_artifact_bytes:
        return Verdict(False, ARTIFACT_TOO_LARGE, f"{len(artifact)} > {max_artifact_bytes} bytes")
    actual = sha256_hex(artifact)
    if actual != d.sha256:
        return Verdict(False, HASH_MISMATCH, f"got {actual[:12]}, deploy says {d.sha256[:12]}")
    if dict(d.metadata) != expected_metadata(d):
        return Verdict(False, METADATA_MISMATCH, f"{dict(d.metadata)} != {expected_metadata(d)}")
    try:
        verify_artifact(fog_key, artifact, ArtifactSignature(d.sha256, d.signer, d.signature, dict(d.metadata)))
    except SecurityError as exc:
        return Verdict(False, BAD_ARTIFACT_SIGNATURE, exc.reason)
    if d.memory_bytes > free_memory_bytes:
        return Verdict(False, INSUFFICIENT_MEMORY, f"needs {d.memory_bytes}, free {free_memory_bytes}")
    return Verdict(True)


def parse_labels(text: str | None) -> dict[str, str]:
    """``k=v,k2=v2`` -> dict; raise ValueError on a malformed item."""
    out: dict[str, str] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"label {item!r} is not k=v")
        out[key.strip()] = value.strip()
    return out


def parse_taints(text: str | None) -> tuple[Taint, ...]:
    """``k=v:NoSchedule,k2:PreferNoSchedule`` -> Taints (effect defaults to NoSchedule)."""
    out = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        body, sep, effect = item.rpartition(":")
        if not sep:
            body, effect = item, "NoSchedule"
        key, _, value = body.partition("=")
        if not key:
            raise ValueError(f"taint {item!r} has no key")
        out.append(Taint(key, value, effect))  # Taint validates the effect
    return tuple(out)
