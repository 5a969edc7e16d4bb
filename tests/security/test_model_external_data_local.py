"""Issue 20 finding 2, the other two processes that load model bytes: the agent and the coordinator.

An edge agent loads partition bytes into onnxruntime, which resolves ONNX external data
against the agent's working directory (``/`` under the shipped unit); a coordinator runs
the release it is about to sign (``fogline release FILE``, an export hook) the same way.
Before: both read the named file into the model. Now the agent's sessions resolve side files
nowhere, and the coordinator refuses such a release in one line before it runs or signs it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_model_external_data import adder

pytest.importorskip("onnxruntime")

SECRET = b"-----BEGIN PRIVATE KEY----- agent"


@pytest.fixture
def secret_in_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A key file named relative to the working directory, as every file is from ``/``."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "device.key").write_bytes(SECRET)
    return "device.key"


def test_an_agent_never_reads_its_files_into_a_partition(secret_in_cwd: str) -> None:
    from edge_agent.executor import Executor, LoadError
    from runtime.topics import Topics

    ex = Executor("dev", Topics("default"), lambda *a, **k: None, None)  # type: ignore[arg-type]
    blob = adder(len(SECRET), location=secret_in_cwd)
    try:
        with pytest.raises(LoadError) as info:
            ex.load(("w", 1, 0, 0), "0" * 64, blob, 1 << 20)
            part = ex.get(("w", 1, 0, 0))
            assert part is not None
            out = part.session.run(None, {"x": np.zeros(len(SECRET), np.uint8)})[0]
            assert bytes(out) != SECRET, "the partition carried the agent's key file"
    finally:
        ex.stop()
    assert "\n" not in str(info.value)


def test_a_coordinator_refuses_to_release_a_model_with_side_files(secret_in_cwd: str, tmp_path: Path) -> None:
    from cloud_coordinator.release import ReleaseError, check_onnx, onnx_file

    path = tmp_path / "model.onnx"
    path.write_bytes(adder(len(SECRET), location=secret_in_cwd))
    for check in (lambda: onnx_file(path), lambda: check_onnx(path.read_bytes())):
        with pytest.raises(ReleaseError) as info:
            check()
        msg = str(info.value)
        assert "\n" not in msg and "external data" in msg and "device.key" not in msg, msg
