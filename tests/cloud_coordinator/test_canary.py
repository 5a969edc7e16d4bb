"""The canary's held-out batch and the coordinator's own onnxruntime run of the release."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cloud_coordinator.canary import held_out_batch, reference_outputs
from cloud_coordinator.release import ReleaseError
from cloud_coordinator.rollout import compare_outputs
from models import zoo


def _blob(batch: int | None = 1) -> bytes:
    r = np.random.default_rng(0)
    return zoo.mlp_from_weights([r.standard_normal((64, 8)), r.standard_normal(8), r.standard_normal((8, 3)),
                                 r.standard_normal(3)], batch=batch).SerializeToString()


def test_random_batch_is_seeded_and_shaped() -> None:
    a, b = held_out_batch(_blob(None), 5, seed=3), held_out_batch(_blob(None), 5, seed=3)
    assert len(a) == 5 and all(r["x"].shape == (1, 64) and r["x"].dtype == np.float32 for r in a)
    assert all(np.array_equal(x["x"], y["x"]) for x, y in zip(a, b))
    out = reference_outputs(_blob(None), a)
    assert [o["logits"].shape for o in out] == [(1, 3)] * 5
    assert compare_outputs(out[0], reference_outputs(_blob(None), a[:1])[0], 1e-4, 1e-5) == ""


def test_holdout_file(tmp_path: Path) -> None:
    x = np.random.default_rng(1).random((3, 64))   # float64 on disk: cast to the model's float32
    np.savez(tmp_path / "h.npz", x=x)
    batch = held_out_batch(_blob(), 8, str(tmp_path / "h.npz"))
    assert len(batch) == 3 and batch[2]["x"].dtype == np.float32 and np.allclose(batch[2]["x"][0], x[2])
    np.savez(tmp_path / "bad.npz", y=x)
    with pytest.raises(ReleaseError, match="has no input 'x' \\(it has y\\)"):
        held_out_batch(_blob(), 8, str(tmp_path / "bad.npz"))
    with pytest.raises(ReleaseError, match="cannot read the held-out batch"):
        held_out_batch(_blob(), 8, str(tmp_path / "missing.npz"))
    np.savez(tmp_path / "rank.npz", x=np.zeros((2, 5)))
    with pytest.raises(ReleaseError, match="does not run on the release here"):
        reference_outputs(_blob(), held_out_batch(_blob(), 2, str(tmp_path / "rank.npz")))
    with pytest.raises(ReleaseError, match="cannot load the release"):
        held_out_batch(b"not onnx", 1)
