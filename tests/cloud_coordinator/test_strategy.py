"""RobustStrategy against an in-process Grid: rounds, malformed replies, quorum, resume, layouts."""
from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Error, MetricRecord, RecordDict

from cloud_coordinator.rounds import Wait, wait_decision
from cloud_coordinator.strategy import CheckpointConfig, RobustStrategy, RoundConfig, RunFailed

from _grid import Crash, LocalGrid, pull_client


def _init() -> ArrayRecord:
    return ArrayRecord({"conv.weight": Array(np.zeros((2, 3), np.float32)),
                        "conv.bias": Array(np.zeros(3, np.float32))})


def _grid(n: int = 5, byz: dict[int, str] | None = None, **kw: Any) -> LocalGrid:
    g = LocalGrid()
    for i in range(n):
        attack = (byz or {}).get(i, "")
        g.add(pull_client(np.float32(i), attack=attack, noise_seed=i,
                          examples=10**8 if attack else 10), **kw)
    return g


def _strategy(rule: str = "trimmed_mean", f: int = 1, *, checkpoint_dirs: Any = (), **rounds: Any) -> RobustStrategy:
    rounds = {"fraction_evaluate": 0.0, "round_timeout": 5.0, "grace": 0.0, **rounds}
    return RobustStrategy(rule, f=f, rounds=RoundConfig(**rounds), checkpoints=CheckpointConfig(dirs=checkpoint_dirs))


def _flat(a: ArrayRecord) -> np.ndarray:
    return np.concatenate([v.numpy().ravel() for v in a.values()])


@pytest.mark.parametrize("rule", ["trimmed_mean", "nnm+centered_clipping", "multi_krum", "bucketing+median"])
def test_crash_and_resume_equals_uninterrupted(tmp_path: Path, rule: str) -> None:
    ref = _strategy(rule, checkpoint_dirs=[tmp_path / "ref"]).start(
        grid=_grid(byz={4: "sign-flip"}), initial_arrays=_init(), num_rounds=4)
    g = _grid(byz={4: "sign-flip"})
    g.crash_on = (3, 1)
    dirs = [tmp_path / "a", tmp_path / "b"]
    with pytest.raises(Crash):
        _strategy(rule, checkpoint_dirs=dirs).start(grid=g, initial_arrays=_init(), num_rounds=4)
    g2 = _grid(byz={4: "sign-flip"})
    got = _strategy(rule, checkpoint_dirs=dirs).start(grid=g2, initial_arrays=_init(), num_rounds=4)
    assert {int(m.metadata.group_id) for m in g2.pushed} == {3, 4}  # only the in-flight round repeats
    np.testing.assert_allclose(_flat(got.arrays), _flat(ref.arrays), rtol=0, atol=1e-6)
    assert sorted(got.train_metrics_clientapp) == [1, 2, 3, 4]  # earlier rounds' metrics restored
    report = json.loads((tmp_path / "a" / "report.json").read_text())
    assert report["resumed_from"] == 2 and [h["round"] for h in report["history"]] == [1, 2, 3, 4]


def test_finished_run_resumes_to_nothing(tmp_path: Path) -> None:
    _strategy(checkpoint_dirs=[tmp_path]).start(grid=_grid(), initial_arrays=_init(), num_rounds=2)
    g = _grid()
    _strategy(checkpoint_dirs=[tmp_path]).start(grid=g, initial_arrays=_init(), num_rounds=2)
    assert g.pushed == []


def test_robust_rule_ignores_inflated_example_counts() -> None:
    res = _strategy().start(grid=_grid(byz={4: "sign-flip"}), initial_arrays=_init(), num_rounds=3)
    assert np.all(np.abs(_flat(res.arrays) - 1.5) < 1.0)  # honest targets 0..3
    mean = _strategy("mean", f=0).start(grid=_grid(byz={4: "sign-flip"}), initial_arrays=_init(), num_rounds=2)
    assert np.all(_flat(mean.arrays) < -10)  # FedAvg by reported counts is captured by the liar


def _bad_clients() -> dict[str, Any]:
    def arrays(**over: Any) -> dict[str, Array]:
        base = {"conv.weight": Array(np.ones((2, 3), np.float32)), "conv.bias": Array(np.ones(3, np.float32))}
        base.update(over)
        return base

    def wrap(content: dict[str, Any], count: Any = 5) -> RecordDict:
        return RecordDict({"arrays": ArrayRecord(content), "metrics": MetricRecord({"num-examples": count})})

    raw = io.BytesIO()
    np.save(raw, np.ones(3, np.float32))
    truncated = Array("float32", (3,), "numpy.ndarray", raw.getvalue()[:-4])
    return {
        "absurd example count": lambda m: wrap(arrays(), float("inf")),
        "wrong array names": lambda m: wrap({"other": Array(np.ones(3, np.float32))}),
        "bad array: declared layout mismatch": lambda m: wrap(arrays(**{"conv.bias": Array(np.ones(4, np.float32))})),
        "bad array: truncated data": lambda m: wrap(arrays(**{"conv.bias": truncated})),
        "client error": lambda m: Error(code=0, reason="boom"),
        "no arrays": lambda m: RecordDict({"metrics": MetricRecord({"num-examples": 1})}),
    }


def test_malformed_replies_are_counted_never_fatal() -> None:
    g = LocalGrid()
    for i in range(3):
        g.add(pull_client(np.float32(i), noise_seed=i))
    bad = _bad_clients()
    for fn in bad.values():
        g.add(fn)
    res = _strategy("median", f=1, min_train_nodes=3).start(grid=g, initial_arrays=_init(), num_rounds=1)
    m = res.train_metrics_clientapp[1]
    assert m["replies"] == 9 and m["usable"] == 3 and m["rejected"] == 6
    for why in bad:
        key = "rejected-" + "".join(c if c.isalnum() else "-" for c in why.lower()).strip("-")
        assert m[key] == 1, (why, dict(m))
    assert np.all(np.abs(_flat(res.arrays) - 0.5) < 0.1)


def test_nan_client_with_trimmed_mean_n3_is_retried_then_stops_loudly(tmp_path: Path) -> None:
    # issue 10 finding 14: one NaN client, trimmed_mean f=1, n=3 -- a failed aggregation never crashes;
    # issue 28: nor does it count as a round (the model would be released untrained)
    g = _grid(3, byz={2: "nan"})
    with pytest.raises(RunFailed) as info:
        _strategy(checkpoint_dirs=[tmp_path], max_attempts=2).start(grid=g, initial_arrays=_init(), num_rounds=2)
    assert "round 1 failed 2 attempts" in str(info.value) and "needs n >= 3 updates for f=1, got n=2" in str(info.value)
    assert json.loads((tmp_path / "fatal.json").read_text())["error"] == str(info.value)
    progress = json.loads((tmp_path / "progress.json").read_text())
    assert progress["round"] == 1 and progress["retries"] == 1 and "got n=2" in progress["retried"]
    assert not (tmp_path / "report.json").exists() and not list(tmp_path.glob("ckpt-*"))


@pytest.mark.integration
def test_f_too_large_for_the_clients_is_one_line_and_nothing_lost(tmp_path: Path) -> None:
    s = RobustStrategy("bulyan", f=1,
                       rounds=RoundConfig(max_attempts=1, round_timeout=1.0, fraction_evaluate=0.0),
                       checkpoints=CheckpointConfig(dirs=[tmp_path]))  # needs 7
    with pytest.raises(RunFailed) as info:
        s.start(grid=_grid(5), initial_arrays=_init(), num_rounds=2)
    assert "\n" not in str(info.value) and "needs 7" in str(info.value)
    assert json.loads((tmp_path / "fatal.json").read_text())["error"] == str(info.value)
    assert not list(tmp_path.glob("ckpt-*")) and not list(tmp_path.glob(".*tmp*"))


def test_quorum_and_grace_do_not_wait_for_a_silent_node() -> None:
    g = _grid(4)
    g.add(lambda m: None)  # never answers
    s = _strategy("median", f=1, min_train_nodes=3)
    res = s.start(grid=g, initial_arrays=_init(), num_rounds=1, timeout=30)
    assert res.train_metrics_clientapp[1]["usable"] == 4


def test_layout_of_a_state_dict_is_kept() -> None:
    init = ArrayRecord({"fc.weight": Array(np.zeros((4, 2), np.float32)), "fc.bias": Array(np.zeros(4, np.float64)),
                        "bn.num_batches_tracked": Array(np.array(0, dtype=np.int64))})
    res = _strategy("median", f=1, min_train_nodes=3).start(grid=_grid(3), initial_arrays=init, num_rounds=1)
    assert list(res.arrays.keys()) == list(init.keys())
    assert [a.dtype for a in res.arrays.values()] == ["float32", "float64", "int64"]
    assert [tuple(a.shape) for a in res.arrays.values()] == [(4, 2), (4,), ()]


def test_unknown_rule_fails_at_construction() -> None:
    from cloud_coordinator.aggregation import AggregationError

    with pytest.raises(AggregationError, match="unknown aggregation rule 'nope'"):
        RobustStrategy("nope")


def test_works_under_flowers_own_round_loop() -> None:
    from flwr.serverapp.strategy import Strategy

    s = _strategy("median", f=1)
    assert isinstance(s, Strategy)
    res = Strategy.start(s, grid=_grid(3), initial_arrays=_init(), num_rounds=2, timeout=5)
    assert 2 in res.train_metrics_clientapp and np.all(_flat(res.arrays) > 0)


@pytest.mark.parametrize("args, want", [
    ((3, 3, 3, 2, 1.0, None, 10, 2), Wait.ALL),
    ((3, 2, 2, 2, 1.0, 0.5, 10, 2), Wait.WAIT),
    ((3, 2, 2, 2, 3.0, 2.5, 10, 2), Wait.QUORUM),
    ((3, 2, 1, 2, 11.0, None, 10, 2), Wait.TIMEOUT),
    ((3, 1, 1, 2, 5.0, None, 10, 2), Wait.WAIT),
])
def test_wait_decision(args: tuple, want: Wait) -> None:  # type: ignore[type-arg]
    assert wait_decision(*args) is want


def test_energy_aware_selection_from_verified_summaries(tmp_path: Path) -> None:
    import time as _time

    from cloud_coordinator.settings import Settings
    from cloud_coordinator.summaries import open_summary, store_summary
    from runtime.messages import DeviceSummary, FleetSummary
    from runtime.security import Identity, Signer

    fog = Identity.from_seed("fog-a", b"k")
    fleet = FleetSummary("fog-a", "lab", _time.time(), (DeviceSummary("node-101", True, battery_level=0.05),
                                                        DeviceSummary("node-102", True, battery_level=0.9)))
    got = open_summary(Signer(fog, 1).seal_bytes(fleet, _time.time()), "fog-a", fog.public_key_bytes, "lab")
    assert not isinstance(got, str)
    store_summary(tmp_path / "summaries", *got)
    s = _strategy("median", f=1)
    s.apply_settings(Settings(str(tmp_path), summaries_dir=str(tmp_path / "summaries"),
                              fog_keys={"fog-a": fog.public_key_bytes.hex()}, fog_sites={"fog-a": "lab"}))
    g = _grid(5)  # node-101 .. node-105; the fog knows two of them
    s.start(grid=g, initial_arrays=_init(), num_rounds=1)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["history"][0]["clients"] == ["node-102", "node-103", "node-104", "node-105"]
