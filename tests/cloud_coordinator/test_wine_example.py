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
