"""Model release: ONNX export, signature, release file, and (last) an MQTT publish."""
from __future__ import annotations

import queue
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from cloud_coordinator.release import Releaser, build_release
from runtime import codec
from runtime.errors import SecurityError
from runtime.messages import ModelRelease
from runtime.security import ArtifactSignature, Identity, verify_artifact
from runtime.topics import Topics

IDENT = Identity.from_seed("coordinator", b"release-test")


def _weights() -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 10)).astype(np.float32), np.zeros(10, np.float32)


def _verify(rel: ModelRelease, key: bytes) -> None:
    verify_artifact(key, rel.artifact, ArtifactSignature(rel.sha256, rel.signer, rel.signature,
                                                         dict(rel.metadata)))


def test_build_release_is_signed_onnx() -> None:
    rel = build_release(_weights(), IDENT, "digits", 4, {"accuracy": "0.9"})
    assert rel.version == 4 and rel.signer == "coordinator" and rel.metadata["format"] == "onnx"
    onnx.checker.check_model(onnx.load_from_string(rel.artifact))
    _verify(rel, IDENT.public_key_bytes)
    assert codec.decode(codec.encode(rel)) == rel
    with pytest.raises(SecurityError):
        _verify(rel, Identity.from_seed("x", b"other").public_key_bytes)
    tampered = ModelRelease(rel.workload, rel.version, rel.sha256, rel.artifact, rel.signature, rel.signer,
                            {**rel.metadata, "version": "5"})
    with pytest.raises(SecurityError):
        _verify(tampered, IDENT.public_key_bytes)


def test_releaser_cadence_writes_files(tmp_path: Path) -> None:
    r = Releaser(tmp_path / "rel", IDENT, "digits", every=2, total_rounds=5)
    for rnd in range(1, 6):
        r.after_round(rnd, _weights(), {"accuracy": 0.5})
    assert [x["version"] for x in r.released] == [2, 4, 5]
    frame = codec.decode((tmp_path / "rel" / "digits-v000005.release").read_bytes())
    assert isinstance(frame, ModelRelease) and frame.metadata["accuracy"] == "0.5000"
    _verify(frame, IDENT.public_key_bytes)


def test_releaser_from_run_config(tmp_path: Path) -> None:
    assert Releaser.from_run_config({"release-every": 0, "rounds": 3}, tmp_path) is None
    r = Releaser.from_run_config({"release-every": 1, "rounds": 3, "workload": "w"}, tmp_path)
    assert r is not None and (tmp_path / "coordinator.key").stat().st_mode & 0o077 == 0


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(),
                    reason="mosquitto not installed")
def test_release_published_over_mqtt(tmp_path: Path) -> None:
    from runtime.broker import start_broker
    from runtime.mqtt import MqttClient

    broker = start_broker(tmp_path / "broker")
    try:
        addr = broker.address  # type: ignore[attr-defined]
        addr = addr() if callable(addr) else addr
        host, port = str(addr).rsplit(":", 1)
        r = Releaser(tmp_path / "rel", IDENT, "digits", every=1, total_rounds=1, site="lab", mqtt=f"{host}:{port}")
        r.after_round(1, _weights(), {})
        assert r.released[0]["published"] is True
        got: queue.Queue[bytes] = queue.Queue()
        sub = MqttClient("fog-test", host, int(port))
        sub.subscribe(Topics("lab").release(), lambda m: got.put(m.payload))
        sub.start()
        try:
            assert sub.wait_connected(10)
            rel = codec.decode(got.get(timeout=10))  # retained: arrives after the fact
        finally:
            sub.stop()
        assert isinstance(rel, ModelRelease) and rel.version == 1
        _verify(rel, IDENT.public_key_bytes)
    finally:
        broker.stop()  # type: ignore[attr-defined]
