"""Release: the export hook's ONNX is checked in onnxruntime, signed, and bad hooks are one line."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from flwr.app import ArrayRecord

from cloud_coordinator.release import (
    Release,
    ReleaseError,
    build_release,
    check_onnx,
    export_onnx,
    read_release,
    resolve_export,
    version_for,
    write_release,
)
from models.train import to_onnx as weights_to_onnx
from runtime import codec
from runtime.errors import SecurityError
from runtime.messages import ModelRelease
from runtime.security import ArtifactSignature, Identity, verify_artifact

IDENT = Identity.from_seed("coord-1", b"release-test")


def _arrays() -> ArrayRecord:
    rng = np.random.default_rng(0)
    return ArrayRecord([rng.normal(size=(64, 10)).astype(np.float32), np.zeros(10, np.float32)])


def _hook(arrays: ArrayRecord) -> onnx.ModelProto:
    return weights_to_onnx(arrays.to_numpy_ndarrays(), batch=1)


def _verify(rel: ModelRelease, key: bytes) -> None:
    verify_artifact(key, rel.artifact, ArtifactSignature(rel.sha256, rel.signer, rel.signature, dict(rel.metadata)))


def test_export_check_sign_write(tmp_path) -> None:  # type: ignore[no-untyped-def]
    blob = export_onnx(_hook, _arrays())
    assert check_onnx(blob)["inputs"] == {"x": [1, 64]}
    rel = build_release(blob, IDENT, "digits", 4, {"round": "4"})
    assert rel.signer == "coord-1" and rel.metadata["version"] == "4"
    _verify(rel, IDENT.public_key_bytes)
    with pytest.raises(SecurityError):
        _verify(rel, Identity.from_seed("x", b"other").public_key_bytes)
    path = write_release(tmp_path, rel)
    assert read_release(path) == rel and codec.decode(path.read_bytes()) == rel
    assert version_for(tmp_path, "digits", 3) == 5 and version_for(tmp_path, "digits", 9) == 9


@pytest.mark.parametrize("hook, msg", [
    (lambda a: 1 / 0, "export hook failed: ZeroDivisionError"),
    (lambda a: "not onnx", "returned str, not ONNX"),
    (lambda a: b"\x00garbage", "not a valid ONNX model"),
])
def test_bad_hooks_are_one_line(hook, msg: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ReleaseError) as info:
        check_onnx(export_onnx(hook, _arrays()))
    assert msg in str(info.value) and "\n" not in str(info.value)


def test_model_that_does_not_run_is_refused() -> None:
    blob = export_onnx(_hook, _arrays())
    with pytest.raises(ReleaseError, match="does not run on its declared input shape"):
        check_onnx(blob, (1, 63))


def test_resolve_export_and_names() -> None:
    assert resolve_export("models.train:to_onnx") is weights_to_onnx
    for ref, msg in (("models.train", "must look like"), ("no_such_mod:f", "cannot import"),
                     ("models.train:nothing", "has no function")):
        with pytest.raises(ReleaseError, match=msg):
            resolve_export(ref)
    with pytest.raises(ReleaseError, match="invalid release name"):
        Release("../etc", export=_hook)
    assert Release("d", export=_hook, every=2).due(4, 5) and Release("d", export=_hook, every=2).due(5, 5)


@pytest.mark.integration
def test_fogline_release_publishes_a_signed_model(mosquitto, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import queue
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "security"))
    from runtime.cli import main
    from runtime.mqtt import MqttClient
    from runtime.topics import Topics

    from _coordinator import FogSigner, make_credentials

    creds = make_credentials(tmp_path / "creds", "coord-x", FogSigner("fog-x", "site-x"))
    model = tmp_path / "m.onnx"
    model.write_bytes(export_onnx(_hook, _arrays()))
    got: queue.Queue[bytes] = queue.Queue()
    sub = MqttClient("fog-x-test", mosquitto.host, mosquitto.port)
    sub.subscribe(Topics("site-x").release("coord-x"), lambda m: got.put(m.payload))
    sub.start(wait_s=5)
    try:
        args = ["--broker", mosquitto.address, "--credentials", str(creds.dir), "--insecure"]
        assert main(["release", str(model), "--name", "digits", "--version", "7", *args]) == 0
        rel = codec.decode(got.get(timeout=10))
        assert isinstance(rel, ModelRelease) and (rel.workload, rel.version, rel.signer) == ("digits", 7, "coord-x")
        _verify(rel, creds.signing.public_key_bytes)
        (tmp_path / "bad.onnx").write_bytes(b"nope")
        capsys.readouterr()
        assert main(["release", str(tmp_path / "bad.onnx"), "--name", "digits", *args]) == 2
        assert "not a valid ONNX model" in capsys.readouterr().err
        assert got.empty()
    finally:
        sub.stop()
