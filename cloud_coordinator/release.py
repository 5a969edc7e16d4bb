"""Train to deploy: the global arrays -> the user's export hook -> checked ONNX -> signed release.

An export hook maps the global ``ArrayRecord`` to ONNX (bytes or an
``onnx.ModelProto``): ``[tool.fogline] export = "package.module:to_onnx"`` in
the app's pyproject, or ``RobustStrategy(release=Release(name, export=...))``.
Before anything is signed the ONNX must load in onnxruntime and run once on
its declared input shape (symbolic dimensions as 1), so a hook that fails or
returns something else stops at the first check with one line, before round
one. The signed ``ModelRelease`` (signer = the coordinator's credential name,
``runtime.security.sign_artifact``) is written to the releases directory; the
coordinator's fog link publishes it to the site's fog broker (not retained),
and ``fogline release`` publishes a model by hand with the same signature.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from runtime import codec
from runtime.errors import DecodeError, FoglineError
from runtime.ids import is_id
from runtime.messages import ModelRelease
from runtime.security import Identity, sign_artifact
from runtime.verify import sha256_hex

from .store import atomic_write

__all__ = ["Release", "ReleaseError", "resolve_export", "export_onnx", "check_onnx", "build_release",
           "write_release", "release_path", "valid_release_name", "read_release", "version_for", "onnx_file",
           "latest_release", "Releaser"]

log = logging.getLogger(__name__)


class ReleaseError(FoglineError):
    """The export hook failed or its output is not a runnable ONNX model."""


def valid_release_name(name: str) -> bool:
    return is_id(name)


@dataclass(frozen=True, slots=True)
class Release:
    """Release the global model as ``name`` every ``every`` rounds (and after the last)."""

    name: str
    export: Callable[[Any], Any] | str
    every: int = 1
    input_shape: tuple[int, ...] | None = None  # shape of the first input for the check run
    metadata: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not valid_release_name(self.name):
            raise ReleaseError(f"invalid release name {self.name!r} (letters, digits, . _ -; at most 64)")
        if self.every < 1:
            raise ReleaseError("a release needs every >= 1")

    def due(self, server_round: int, last_round: int) -> bool:
        return server_round % self.every == 0 or server_round == last_round

    def hook(self) -> Callable[[Any], Any]:
        return resolve_export(self.export) if isinstance(self.export, str) else self.export


def resolve_export(ref: str) -> Callable[[Any], Any]:
    """``package.module:function`` -> the function; one-line ``ReleaseError`` when it is not there."""
    mod_name, sep, attr = ref.partition(":")
    if not sep or not mod_name or not attr:
        raise ReleaseError(f"export hook {ref!r} must look like 'package.module:function'")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as exc:  # noqa: BLE001 - the user's module may raise anything on import
        raise ReleaseError(f"export hook {ref!r}: cannot import {mod_name} ({type(exc).__name__}: {exc})"
                           ) from None
    fn = getattr(mod, attr, None)
    if not callable(fn):
        raise ReleaseError(f"export hook {ref!r}: {mod_name} has no function {attr!r}")
    return fn  # type: ignore[no-any-return]


def export_onnx(hook: Callable[[Any], Any], arrays: Any) -> bytes:
    """Call the hook; its ONNX as bytes (a ModelProto is serialised), or a one-line ``ReleaseError``."""
    try:
        out = hook(arrays)
    except Exception as exc:  # noqa: BLE001 - any failure of user code is one error line
        raise ReleaseError(f"export hook failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                           ) from None
    if isinstance(out, (bytes, bytearray, memoryview)):
        return bytes(out)
    serialize = getattr(out, "SerializeToString", None)
    if callable(serialize):
        return bytes(serialize())
    raise ReleaseError(f"export hook returned {type(out).__name__}, not ONNX bytes or an onnx.ModelProto")


_ORT_TYPES = {"tensor(float)": np.float32, "tensor(double)": np.float64, "tensor(float16)": np.float16,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(int8)": np.int8,
              "tensor(uint8)": np.uint8, "tensor(bool)": np.bool_}


def check_onnx(blob: bytes, input_shape: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Load the model in onnxruntime and run it once on zeros of its declared input shapes.

    Returns the inputs' names and the shapes used; ``ReleaseError`` if it is not ONNX,
    does not load or does not run.
    """
    import onnx

    from models.external import external_tensors, inline_only

    try:
        model = onnx.load_from_string(blob)
        ext = external_tensors(model)
        if not ext:
            onnx.checker.check_model(model)
    except Exception as exc:  # noqa: BLE001 - protobuf and checker errors are one error
        raise ReleaseError(f"export hook output is not a valid ONNX model ({type(exc).__name__})") from None
    if ext:  # onnxruntime would read them from this process's working directory; the fog refuses them
        raise ReleaseError(inline_only("the release", ext[0].name))
    try:
        import onnxruntime as ort

        sess = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001
        raise ReleaseError(f"onnxruntime cannot load the exported model: {str(exc).splitlines()[0][:200]}"
                           ) from None
    feeds: dict[str, np.ndarray] = {}
    for i, inp in enumerate(sess.get_inputs()):
        dtype = _ORT_TYPES.get(inp.type)
        if dtype is None:
            raise ReleaseError(f"exported model input {inp.name!r} has unsupported type {inp.type}")
        shape = tuple(input_shape) if (i == 0 and input_shape) else tuple(
            d if isinstance(d, int) and d > 0 else 1 for d in inp.shape)
        feeds[inp.name] = np.zeros(shape, dtype=dtype)
    try:
        outs = sess.run(None, feeds)
    except Exception as exc:  # noqa: BLE001
        raise ReleaseError(f"the exported model does not run on its declared input shape "
                           f"({str(exc).splitlines()[0][:200]})") from None
    return {"inputs": {k: list(v.shape) for k, v in feeds.items()},
            "outputs": [list(np.shape(o)) for o in outs]}


def build_release(blob: bytes, identity: Identity, name: str, version: int,
                  metadata: Mapping[str, str] | None = None) -> ModelRelease:
    """Hash and sign ONNX bytes; the signed metadata is exactly ``ModelRelease.metadata``."""
    if not valid_release_name(name):
        raise ReleaseError(f"invalid release name {name!r}")
    if version < 1:
        raise ReleaseError("release versions start at 1")
    meta = {"workload": name, "version": str(version), "format": "onnx",
            **{str(k): str(v) for k, v in dict(metadata or {}).items()}}
    sig = sign_artifact(identity, blob, meta)
    return ModelRelease(name, version, sig.sha256, blob, sig.signature, identity.name, meta)


def release_path(out_dir: Path, name: str, version: int) -> Path:
    return out_dir / f"{name}-v{version:09d}.release"


def write_release(out_dir: Path, rel: ModelRelease) -> Path:
    """The encoded release, atomically, in the releases outbox (what the fog link publishes)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = release_path(out_dir, rel.workload, rel.version)
    atomic_write(path, codec.encode(rel))
    return path


def read_release(path: Path) -> ModelRelease:
    """A release file from the outbox (the coordinator wrote it; still decoded defensively)."""
    try:
        msg = codec.decode(path.read_bytes())
    except (OSError, DecodeError) as exc:
        raise ReleaseError(f"{path.name}: unreadable release ({exc})") from None
    if not isinstance(msg, ModelRelease):
        raise ReleaseError(f"{path.name}: not a release")
    return msg


def version_for(out_dir: Path, name: str, server_round: int) -> int:
    """Versions only grow: the round, or one past the newest already in the outbox for ``name``."""
    newest = 0
    if out_dir.is_dir():
        for p in out_dir.glob(f"{name}-v*.release"):
            try:
                newest = max(newest, int(p.stem.rsplit("-v", 1)[1]))
            except (IndexError, ValueError):
                continue
    return server_round if server_round > newest else newest + 1


def latest_release(out_dir: Path, name: str) -> tuple[int, str] | None:
    """(version, sha256) of the newest readable release of ``name`` in the outbox (rollbacks too), or None."""
    found: list[tuple[int, Path]] = []
    for p in out_dir.glob(f"{name}-v*.release") if out_dir.is_dir() else ():
        try:
            found.append((int(p.stem.rsplit("-v", 1)[1]), p))
        except (IndexError, ValueError):
            continue
    for version, path in sorted(found, reverse=True):
        try:
            return version, read_release(path).sha256
        except ReleaseError:
            continue
    return None


def onnx_file(path: str | Path) -> bytes:
    """Bytes of an ONNX file given by hand (``fogline release``), checked like an export."""
    try:
        blob = Path(path).read_bytes()
    except OSError as exc:
        raise ReleaseError(f"cannot read {path}: {exc.strerror or exc}") from None
    check_onnx(blob)
    return blob


class Releaser:
    """``RobustStrategy``'s release collaborator: a changed model that passed its checks becomes a signed
    release in ``out_dir``; the same bytes under a new number would claim that training happened, so an
    unchanged model is reported as such and not released."""

    def __init__(self, release: Release, signer: Callable[[], Identity]) -> None:
        self.release = release
        self._signer = signer  # asked only when something is released (no key made for an unchanged model)
        self._last: tuple[int, str] | None = None  # (version, sha256) of the newest release of the model

    def check(self, arrays: Any) -> None:
        """Before round one: the hook exports ONNX that runs (``ReleaseError`` otherwise)."""
        check_onnx(export_onnx(self.release.hook(), arrays), self.release.input_shape)

    def publish(self, rnd: int, arrays: Any, entry: Mapping[str, Any], out_dir: Path) -> dict[str, Any]:
        """Export, check, sign and write round ``rnd``'s release to ``out_dir``; a failure is logged, training
        goes on."""
        rel = self.release
        try:
            blob = export_onnx(rel.hook(), arrays)
            info = check_onnx(blob, rel.input_shape)
        except ReleaseError as exc:
            log.error("round %d: release skipped: %s", rnd, exc)
            return {"round": rnd, "error": str(exc)}
        sha = sha256_hex(blob)
        last = self._last if self._last is not None else latest_release(out_dir, rel.name)
        if last is not None and last[1] == sha:
            log.info("round %d: the model is unchanged since %s v%d (%s): not released", rnd, rel.name, last[0],
                     sha[:12])
            self._last = last
            return {"round": rnd, "unchanged": True, "version": last[0], "sha256": sha}
        version = version_for(out_dir, rel.name, rnd)
        server = entry.get("server") or {}
        meta = {"round": str(rnd), **{str(k): str(v) for k, v in rel.metadata.items()},
                **({"accuracy": f"{float(server['accuracy']):.4f}"} if "accuracy" in server else {})}
        signed = build_release(blob, self._signer(), rel.name, version, meta)
        path = write_release(out_dir, signed)
        self._last = (version, signed.sha256)
        log.info("released %s v%d (%s, %d bytes)", signed.workload, version, signed.sha256[:12], len(blob))
        return {"round": rnd, "version": version, "sha256": signed.sha256, "path": str(path), "bytes": len(blob),
                "signer": signed.signer, "inputs": info["inputs"]}
