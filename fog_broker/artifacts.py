"""Partition artifacts for deploys: model resolution, chain profile, split, sign; cached.

A workload's ``model`` is ``zoo:NAME`` (built locally by ``models.zoo``) or
``file:SHA256`` (an ONNX file an operator uploaded with ``fogline deploy``, or a
coordinator's release, kept under ``DATA_DIR/models/``). Never a path on the fog
host: a remote request must not be able to read, or probe for, local files.
Uploads are checked (hash, size quota, ONNX structure, weights inline: ONNX external
data would name files on the fog host) before they are stored,
and blobs no workload or release refers to any more are deleted (``collect``).
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
Shapes = tuple[tuple[str, tuple[int, ...]], ...]  # a workload's input_shapes, hashable


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
                 max_cached: int = 256, quota_bytes: int = 2 << 30) -> None:
        self.quota_bytes = quota_bytes
        self.identity = identity
        self.models_dir = Path(models_dir)
        self.models_dir.mkdir(parents=True, exist_ok=True)
        self.max_segments = max_segments
        self.max_cached = max_cached
        self._models: dict[str, Any] = {}
        self._analyses: dict[tuple[str, Shapes], Any] = {}
        self._profiles: dict[tuple[str, Shapes], Any] = {}
        self._splits: dict[tuple[str, Shapes, int, int], BuiltPartition] = {}
        self._lock = threading.Lock()
        self.builds = 0
        self.hits = 0

    # ------------------------------------------------------------ models

    def store_blob(self, data: bytes, *, expect_sha: str | None = None) -> str:
        """Check and keep an ONNX file; returns its model reference ``file:SHA``.

        Refused (``RemoteViolation``, nothing written): a hash other than ``expect_sha``, a
        store over its quota, bytes that are not a structurally valid ONNX model.
        """
        sha = sha256_hex(data)
        if expect_sha is not None and sha != expect_sha:
            raise RemoteViolation(f"uploaded model does not hash to {str(expect_sha)[:12]}")
        path = self.models_dir / f"{sha}.onnx"
        if path.exists():
            return f"file:{sha}"
        if self.stored_bytes() + len(data) > self.quota_bytes:
            raise RemoteViolation(f"model store full: {len(data)} more bytes would pass the "
                                  f"{self.quota_bytes >> 20} MiB quota; undeploy workloads to free space")
        _check_onnx(data)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_bytes(data)
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)
        return f"file:{sha}"

    def has_blob(self, ref: str) -> bool:
        return ref.startswith("file:") and bool(_SHA.match(ref[5:])) and (self.models_dir / f"{ref[5:]}.onnx").exists()

    def stored_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.models_dir.glob("*.onnx"))

    def collect(self, keep: set[str]) -> int:
        """Delete stored blobs whose ``file:SHA`` is not in ``keep``; returns how many went."""
        gone = 0
        for p in self.models_dir.glob("*.onnx"):
            ref = f"file:{p.stem}"
            if ref not in keep:
                p.unlink(missing_ok=True)
                with self._lock:
                    self._models.pop(ref, None)
                    caches: tuple[dict[Any, Any], ...] = (self._analyses, self._profiles, self._splits)
                    for cache in caches:  # keyed (ref, ...) each
                        for k in [k for k in cache if k[0] == ref]:
                            del cache[k]
                gone += 1
        for p in self.models_dir.glob("*.tmp"):  # left by a crash mid-write
            p.unlink(missing_ok=True)
        return gone

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
            _refuse_external(model)  # a blob stored before side files were refused at the door
        else:
            raise RemoteViolation(f"model {ref[:80]!r} is neither zoo:NAME nor an uploaded file:SHA256")
        self._models[ref] = model
        return model

    def _analysis(self, ref: str, shapes: Shapes) -> Any:
        """One sizing of ``ref`` for these input shapes (symbolic dims left over pinned to 1), cached."""
        key = (ref, shapes)
        ga = self._analyses.get(key)
        if ga is None:
            from models.graph import serving_dims
            from models.probe import analyze
            model = self._load(ref)
            given = dict(shapes)
            try:
                ga = analyze(model, dims=serving_dims(model, given), input_shapes=given or None)
            except Exception as exc:  # noqa: BLE001 - any model failure is the uploader's problem
                raise RemoteViolation(f"cannot profile model {ref[:80]!r}: {exc}"[:300]) from None
            self._analyses[key] = ga
        return ga

    def profile(self, ref: str, input_shapes: Shapes = ()) -> dict[str, Any]:
        """The COST_MODEL chain profile of a model for these input shapes (cached)."""
        with self._lock:
            return dict(self._profile_locked(ref, tuple(input_shapes)).to_dict())

    def _profile_locked(self, ref: str, shapes: Shapes) -> Any:
        key = (ref, shapes)
        prof = self._profiles.get(key)
        if prof is None:
            try:
                prof = model_profile(self._analysis(ref, shapes), self.max_segments)
            except RemoteViolation:
                raise
            except Exception as exc:  # noqa: BLE001 - any model failure is the uploader's problem
                raise RemoteViolation(f"cannot profile model {ref[:80]!r}: {exc}"[:300]) from None
            self._profiles[key] = prof
        return prof

    def io_spec(self, ref: str) -> dict[str, list[dict[str, Any]]]:
        """The model's own inputs and outputs: name, numpy dtype name, shape (-1 for a dynamic dim)."""
        import onnx

        with self._lock:
            model = self._load(ref)
        inits = {t.name for t in model.graph.initializer}

        def rows(vis: Any) -> list[dict[str, Any]]:
            out = []
            for vi in vis:
                if vi.name in inits:
                    continue
                tt = vi.type.tensor_type
                dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name if tt.elem_type else "unknown"
                shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else -1
                         for d in tt.shape.dim] if tt.HasField("shape") else []
                out.append({"name": vi.name, "dtype": dtype, "shape": shape})
            return out
        return {"inputs": rows(model.graph.input), "outputs": rows(model.graph.output)}

    # ------------------------------------------------------------ partitions

    def build(self, ref: str, first: int, last: int, input_shapes: Shapes = ()) -> BuiltPartition:
        """The unsigned partition of segments first..last (inclusive), cached."""
        from models.partition import split_by_segments
        shapes = tuple(input_shapes)
        key = (ref, shapes, first, last)
        with self._lock:
            hit = self._splits.get(key)
            if hit is not None:
                self.hits += 1
                return hit
            art = split_by_segments(self._analysis(ref, shapes), self._profile_locked(ref, shapes),
                                    [(first, last)])[0]
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


def _check_onnx(data: bytes) -> None:
    """Structural check of an uploaded model (parse + onnx.checker), before it is stored."""
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load_model_from_string(data)
    except (DecodeError, ValueError, RuntimeError) as exc:  # as models.graph's loader
        raise RemoteViolation(f"uploaded file is not a valid ONNX model: {_first_line(exc)}") from None
    _refuse_external(model)
    try:
        onnx.checker.check_model(model)
    except Exception as exc:  # noqa: BLE001 - protobuf and checker raise many kinds; all mean "not ONNX"
        raise RemoteViolation(f"uploaded file is not a valid ONNX model: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return (text.splitlines()[0] if text else type(exc).__name__)[:160]


def _refuse_external(model: Any) -> None:
    """Model bytes are data, never paths: weights in side files (ONNX external data) would name
    files on the fog host (resolved from its working directory), so such a model is refused."""
    from models.external import external_tensors, inline_only

    ext = external_tensors(model)
    if ext:
        raise RemoteViolation(inline_only("uploaded model", ext[0].name))


def model_profile(model: Any, max_segments: int = MAX_SEGMENTS, input_shapes: Any = None) -> Any:
    """The chain profile the scheduler places, for ``fogline place`` and the broker alike.

    ``model`` is a path, a proto or a ``GraphAnalysis``; symbolic input dims that
    ``input_shapes`` leaves open are pinned to 1 (one request at a time, as the fog serves).
    "balanced" keeps cuts near FLOP quantiles: the cheapest-bytes cuts of a CNN all
    sit at its tail, which would leave one partition with nearly all the work.
    """
    from models.cuts import chain_profile
    from models.graph import GraphAnalysis, serving_dims
    from models.graph_files import load_model
    from models.probe import analyze

    if not isinstance(model, GraphAnalysis):
        given = dict(input_shapes or {})
        proto = load_model(model) if isinstance(model, (str, Path)) else model
        model = analyze(model, dims=serving_dims(proto, given), input_shapes=given or None)
    return chain_profile(model, max_segments, strategy="balanced")
