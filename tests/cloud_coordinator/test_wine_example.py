"""examples/wine, the app ``fogline bench wine`` measures: a Flower App with no client evaluation.

What the benchmark's before/after comparison rests on: the coordinator sees that its ClientApp
cannot evaluate (so no evaluate Messages go out), and the app's numpy model trains on its own.
"""
from __future__ import annotations

import sys

import numpy as np

from cloud_coordinator.app import bundled_app, load_app


def test_the_wine_app_has_no_client_evaluation_and_its_config_takes_the_coordinator_flags() -> None:
    spec = load_app(bundled_app("wine"))
    assert spec.client_evaluate is False
    # fogline coordinator --rounds/--rule/--f/--min-clients/--round-timeout/--grace/--seed override these keys
    assert {"num-server-rounds", "rule", "f", "min-train-nodes", "round-timeout", "grace", "seed"} <= set(spec.config)


def test_federated_averaging_of_the_wine_model_learns() -> None:
    sys.path.insert(0, str(bundled_app("wine")))
    try:
        from wine_app.task import fit, held_out, initial, partition, score
    finally:
        sys.path.remove(str(bundled_app("wine")))
    w = initial()
    for _ in range(3):
        local = [fit(w, *partition(0, i, 10), 5, 0.2) for i in range(10)]
        w = [np.mean([m[k] for m in local], axis=0) for k in range(2)]
    loss, acc = score(w, *held_out(0))
    assert acc > 0.9 and loss < 0.4


def test_the_acceptance_benchmarks_user_app_exports_a_model_the_fog_can_serve(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """``fogline bench wine-load`` builds its app outside the repository: a release hook whose ONNX runs and
    predicts what the numpy model predicts, and a ClientApp that sends NaN on ``send-nan=1``."""
    import onnxruntime as ort
    from flwr.app import ArrayRecord

    from benchmarks.wine_load_bench import make_app
    from cloud_coordinator.release import check_onnx, export_onnx

    app = make_app(tmp_path)
    spec = load_app(app)
    assert (spec.export, spec.release, spec.input_shape) == ("wine_app.export:to_onnx", "wine", (1, 13))
    assert "send-nan" in (app / "wine_app" / "client_app.py").read_text()
    sys.path.insert(0, str(app))
    try:
        for mod in [m for m in sys.modules if m == "wine_app" or m.startswith("wine_app.")]:
            del sys.modules[mod]  # the bundled example's package, if an earlier test imported it
        from wine_app.export import to_onnx
        from wine_app.task import held_out
    finally:
        sys.path.remove(str(app))
    rng = np.random.default_rng(0)
    w = [rng.normal(size=(13, 3)), rng.normal(size=3)]
    blob = export_onnx(to_onnx, ArrayRecord(w))
    check_onnx(blob, (1, 13))
    x = held_out(0)[0][:10].astype(np.float32)
    sess = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    got = [int(np.argmax(sess.run(None, {"x": x[i:i + 1]})[0])) for i in range(len(x))]
    assert got == list((x @ w[0] + w[1]).argmax(1))
