"""Partition artifacts for deploys: model resolution, chain profile, split, sign; cached.

A workload's ``model`` is ``zoo:NAME`` (built locally by ``models.zoo``) or
``file:SHA256`` (an ONNX file the operator uploaded with ``fogline deploy``,
kept under ``DATA_DIR/models/``), or a local path (trusted local use only).
Splits are cached per (model, first, last): a re-placement of a lost partition
reuses the bytes of the first deploy, so only the signature is new.
"""
from __future__ import annotations

import logging
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runtime.errors import RemoteViolation
from runtime.security import ArtifactSignature, Identity, sha256_hex, sign_artifact

__all__ = ["ArtifactBuilder", "BuiltPartition", "MAX_SEGMENTS", "MODEL_SCHEMES", "model_profile"]

log = logging.getLogger(__name__)

MAX_SEGMENTS = 16
# Model references that name no local file: built-in zoo models, uploaded files, coordinator releases.
MODEL_SCHEMES = ("zoo:", "file:", "release:")
_SHA = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class BuiltPartition:
    onnx_bytes: bytes
    sha256: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    memory_bytes: int


class ArtifactBuilder:
    """Owns loaded models, their chain profiles and the split cache (thread-safe)."""

    def __init__(self, identity: Identity, models_dir: str | Path, *, max_segments: int = MAX_SEGMENTS,
                 max_cached: int = 256) -> None:
        self.identity = identity
        self.models_dir = Path(models_dir)
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self.max_segments = max_segments
        self.max_cached = max_cached
        self._models: dict[str, Any] = {}
        self._profiles: dict[str, Any] = {}
        self._splits: dict[tuple[str, int, int], BuiltPartition] = {}
        self._lock = threading.Lock()
        self.builds = 0
        self.hits = 0

    # ------------------------------------------------------------ models

    def store_blob(self, data: bytes) -> str:
        """Keep an uploaded ONNX file; returns its model reference ``file:SHA``."""
        sha = sha256_hex(data)
        path = self.models_dir / f"{sha}.onnx"
        if not path.exists():
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return f"file:{sha}"

    def _load(self, ref: str) -> Any:
        import onnx  # heavy: only when a model is needed

        from models import zoo
        if ref in self._models:
            return self._models[ref]
        if ref.startswith("zoo:"):
            name = ref[4:]
            if name not in zoo.NAMES:
                raise RemoteViolation(f"unknown zoo model {name!r}; known: {', '.join(zoo.NAMES)}")
            model = zoo.build(name)
        elif ref.startswith("file:"):
            sha = ref[5:]
            if not _SHA.match(sha):
                raise RemoteViolation(f"bad model reference {ref[:80]!r}")
            path = self.models_dir / f"{sha}.onnx"
            if not path.exists():
                raise RemoteViolation(f"model {sha[:12]} was never uploaded to this fog broker")
            model = onnx.load_model_from_string(path.read_bytes())
        else:
            path = Path(ref)
            if not path.is_file():
                raise RemoteViolation(f"model {ref[:120]!r} is neither zoo:NAME nor an uploaded file")
            model = onnx.load(str(path))
        model = _pin_symbolic_dims(model)
        self._models[ref] = model
        return model

    def profile(self, ref: str) -> dict[str, Any]:
        """The COST_MODEL chain profile of a model (cached)."""
        with self._lock:
            return dict(self._profile_locked(ref).to_dict())

    def _profile_locked(self, ref: str) -> Any:
        prof = self._profiles.get(ref)
        if prof is None:
            try:
                prof = model_profile(self._load(ref), self.max_segments)
            except RemoteViolation:
                raise
            except Exception as exc:  # noqa: BLE001 - any model failure is the uploader's problem
                raise RemoteViolation(f"cannot profile model {ref[:80]!r}: {exc}"[:300]) from None
            self._profiles[ref] = prof
        return prof

    # ------------------------------------------------------------ partitions

    def build(self, ref: str, first: int, last: int) -> BuiltPartition:
        """The unsigned partition of segments first..last (inclusive), cached."""
        from models.partition import split_by_segments
        key = (ref, first, last)
        with self._lock:
            hit = self._splits.get(key)
            if hit is not None:
                self.hits += 1
                return hit
            art = split_by_segments(self._load(ref), self._profile_locked(ref), [(first, last)])[0]
            built = BuiltPartition(art.onnx_bytes, art.sha256, art.input_names, art.output_names,
                                   int(art.memory_bytes))
            if len(self._splits) >= self.max_cached:
                self._splits.pop(next(iter(self._splits)))
            self._splits[key] = built
            self.builds += 1
            return built

    def sign(self, built: BuiltPartition, workload: str, version: int, replica: int,
             index: int) -> ArtifactSignature:
        meta = {"workload": workload, "version": str(version), "replica": str(replica), "index": str(index)}
        return sign_artifact(self.identity, built.onnx_bytes, meta)


def _pin_symbolic_dims(model: Any) -> Any:
    """Serve one request at a time: symbolic input dims (a batch ``N``) are pinned to 1."""
    names = {d.dim_param for vi in model.graph.input for d in vi.type.tensor_type.shape.dim
             if d.HasField("dim_param")}
    if not names:
        return model
    from models.graph import pin_dims
    log.info("pinning symbolic dims %s to 1", sorted(names))
    return pin_dims(model, {n: 1 for n in names})


def model_profile(model: Any, max_segments: int = MAX_SEGMENTS) -> Any:
    """The chain profile the scheduler places, for ``fogline place`` and the broker alike.

    "balanced" keeps cuts near FLOP quantiles: the cheapest-bytes cuts of a CNN all
    sit at its tail, which would leave one partition with nearly all the work.
    """
    from models.cuts import chain_profile

    return chain_profile(_pin_symbolic_dims(model), max_segments, strategy="balanced")
